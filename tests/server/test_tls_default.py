"""TLS is the default on the ext_proc port; plaintext only by explicit choice; certificate
files are re-read when they change (a rotated secret), and a half-rotated pair is refused."""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc.cli import _serve_settings, build_parser
from extproc.config import ServerSettings, TLSSettings, decode_settings
from extproc.endpoints import parse_endpoints
from extproc.errors import ConfigError
from extproc.server.app import App
from extproc.server.tls import self_signed
from tests.conftest import ENDPOINTS, with_server

PEM = Encoding.PEM


def served_certificate(port: int) -> x509.Certificate:
    """The certificate a new TLS connection to the gRPC port is given (ALPN h2, as Envoy)."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    ctx.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="localhost") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der)


def test_tls_is_the_default_and_plaintext_is_explicit():
    assert ServerSettings().effective_tls == TLSSettings(self_signed=True)
    assert ServerSettings(plaintext=True).effective_tls is None
    with pytest.raises(ConfigError, match="not both"):
        decode_settings({"server": {"plaintext": True, "tls": {"self_signed": True}}})
    args = build_parser().parse_args(["serve", "--plaintext"])
    assert _serve_settings(args).server.effective_tls is None


async def test_default_picker_refuses_plaintext_and_answers_health_over_tls(settings):
    s = with_server(settings, plaintext=False)
    async with App(s, parse_endpoints(",".join(ENDPOINTS))) as app:
        cert = await asyncio.to_thread(served_certificate, app.port)
        assert cert.issuer == cert.subject  # self-signed
        creds = grpc.ssl_channel_credentials(root_certificates=cert.public_bytes(PEM))
        opts = (("grpc.ssl_target_name_override", "localhost"),)
        async with grpc.aio.secure_channel(f"127.0.0.1:{app.port}", creds, options=opts) as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            for name in (
                "inference-extension",
                "readiness",
                "envoy.service.ext_proc.v3.ExternalProcessor",
            ):
                resp = await stub.Check(health_pb2.HealthCheckRequest(service=name), timeout=5)
                assert resp.status == health_pb2.HealthCheckResponse.SERVING, name
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            with pytest.raises(grpc.aio.AioRpcError):
                await stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=2)


def write_pair(dir: Path, name: str) -> x509.Certificate:
    pair = self_signed((name,))
    # Written beside, then renamed: how a rotated Kubernetes secret appears (atomic swap).
    for suffix, data in (("crt", pair.cert_pem), ("key", pair.key_pem)):
        tmp = dir / f".tls.{suffix}.tmp"
        tmp.write_bytes(data)
        os.replace(tmp, dir / f"tls.{suffix}")
    return x509.load_pem_x509_certificate(pair.cert_pem)


async def test_certificate_files_are_reloaded_when_they_change(settings, tmp_path: Path):
    first = write_pair(tmp_path, "first.example")
    tls = TLSSettings(cert_file=str(tmp_path / "tls.crt"), key_file=str(tmp_path / "tls.key"))
    async with App(
        with_server(settings, tls=tls, plaintext=False), parse_endpoints(",".join(ENDPOINTS))
    ) as app:
        assert (await asyncio.to_thread(served_certificate, app.port)) == first
        second = write_pair(tmp_path, "second.example")
        assert (await asyncio.to_thread(served_certificate, app.port)) == second
        assert app.tls_reloader.reloads == 1
        # A rotation caught half-way (new key, old certificate) is not taken.
        other = self_signed(("third.example",))
        (tmp_path / "tls.key").write_bytes(other.key_pem)
        assert (await asyncio.to_thread(served_certificate, app.port)) == second
        assert app.tls_reloader.rejected == 1
