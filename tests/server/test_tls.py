"""TLS on the ext_proc port (certificate files or self-signed at start); the health port
stays plaintext for kubelet probes; Redis ACL credentials travel in the Redis URL."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterator
from pathlib import Path

import grpc
import msgspec
import orjson
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from extproc import protocol
from extproc.config import IndexSettings, Settings, TLSSettings, decode_settings
from extproc.endpoints import parse_endpoints
from extproc.errors import ConfigError
from extproc.server.app import App
from extproc.server.tls import self_signed
from extproc.testing import body_chunks, destination, pb, post, request_headers
from tests.conftest import ENDPOINTS, with_server
from tests.redis_servers import REDIS_SERVER, RedisServer, free_port

# Long enough for several prefix blocks, so routing looks the prefix up in the index.
CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hello " * 200}]})


async def routed_over(channel: grpc.aio.Channel) -> str | None:
    call = channel.stream_stream(
        protocol.EXT_PROC_METHOD,
        request_serializer=pb.ProcessingRequest.SerializeToString,
        response_deserializer=pb.ProcessingResponse.FromString,
    )()
    for m in (request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)):
        await call.write(m)
    await call.done_writing()
    responses = [r async for r in call]
    return destination(responses[0])


def secure(port: int, root_pem: bytes) -> grpc.aio.Channel:
    return grpc.aio.secure_channel(
        f"127.0.0.1:{port}",
        grpc.ssl_channel_credentials(root_certificates=root_pem),
        # The certificate names localhost (and 127.0.0.1); check the name, not just the key.
        options=(("grpc.ssl_target_name_override", "localhost"),),
    )


async def test_tls_with_certificate_files_routes_and_refuses_plaintext(settings, tmp_path):
    pair = self_signed()
    (tmp_path / "tls.crt").write_bytes(pair.cert_pem)
    (tmp_path / "tls.key").write_bytes(pair.key_pem)
    tls = TLSSettings(cert_file=str(tmp_path / "tls.crt"), key_file=str(tmp_path / "tls.key"))
    s = with_server(settings, tls=tls, plaintext=False)
    async with App(s, parse_endpoints(",".join(ENDPOINTS))) as app:
        async with secure(app.port, pair.cert_pem) as ch:
            assert await routed_over(ch) in ENDPOINTS
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            with pytest.raises(grpc.aio.AioRpcError):
                await routed_over(ch)


async def test_self_signed_certificate_is_generated_and_health_port_stays_plaintext(settings):
    s = with_server(settings, tls=TLSSettings(self_signed=True), plaintext=False)
    async with App(s, parse_endpoints(",".join(ENDPOINTS))) as app:
        pem = await asyncio.to_thread(ssl.get_server_certificate, ("127.0.0.1", app.port))
        async with secure(app.port, pem.encode()) as ch:
            assert await routed_over(ch) in ENDPOINTS
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.health_port}") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            resp = await stub.Check(health_pb2.HealthCheckRequest(service="readiness"))
            assert resp.status == health_pb2.HealthCheckResponse.SERVING


@pytest.mark.parametrize(
    ("tls", "message"),
    [
        ({"cert_file": "a.crt"}, "needs cert_file and key_file"),
        ({"self_signed": True, "key_file": "a.key"}, "not both"),
    ],
)
def test_incomplete_tls_settings_fail_at_load_naming_the_field(tls, message):
    with pytest.raises(ConfigError) as err:
        decode_settings({"server": {"tls": tls}})
    assert message in str(err.value)
    assert "server" in str(err.value) and "tls" in str(err.value)


async def test_missing_certificate_file_is_a_config_error(settings, tmp_path):
    tls = TLSSettings(cert_file=str(tmp_path / "no.crt"), key_file=str(tmp_path / "no.key"))
    with pytest.raises(ConfigError):
        async with App(
            with_server(settings, tls=tls, plaintext=False), parse_endpoints(",".join(ENDPOINTS))
        ):
            pass


@pytest.fixture
def acl_redis(tmp_path: Path) -> Iterator[RedisServer]:
    """A Redis whose default user may only PING (so the fixture's readiness check works) and
    whose `picker` user, password `s3cret`, may do everything."""
    if REDIS_SERVER is None:
        pytest.skip("redis-server not installed")
    server = RedisServer(
        free_port(),
        tmp_path,
        # One argument per ACL rule: redis-server joins them into the `user` directive.
        (
            *("--user", "default", "on", "nopass", "-@all", "+ping"),
            *("--user", "picker", "on", ">s3cret", "~*", "&*", "+@all"),
        ),
    )
    server.start()
    try:
        yield server
    finally:
        server.kill()


async def picker_with_redis(settings: Settings, url: str) -> tuple[str | None, bool]:
    """One decision through a picker using the Redis at `url`: (destination, degraded)."""
    # A generous lookup budget: the point is the credentials, and on a loaded CI machine the
    # production 5 ms budget can expire on the first lookup (seen once in CI).
    index = IndexSettings(backend="redis", redis_url=url, lookup_budget_s=2.0)
    s = msgspec.structs.replace(settings, index=index)
    async with App(s, parse_endpoints(",".join(ENDPOINTS))) as app:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as ch:
            dest = await routed_over(ch)
        assert app.router.stats.prefix_blocks_requested > 0  # the index was consulted
        return dest, app.router.stats.lookups_degraded > 0


async def test_redis_acl_credentials_in_the_url_are_used(settings, acl_redis):
    url = f"redis://picker:s3cret@127.0.0.1:{acl_redis.port}"
    dest, degraded = await picker_with_redis(settings, url)
    assert dest in ENDPOINTS and not degraded


async def test_redis_without_credentials_routes_degraded(settings, acl_redis):
    dest, degraded = await picker_with_redis(settings, acl_redis.url)
    # Routed on load alone: the index refused every command, the requests still pass.
    assert dest in ENDPOINTS and degraded
