"""Server credentials for the ext_proc port: PEM files from `server.tls`, or a key and
self-signed certificate generated in memory at start (nothing written to disk).

TLS is the default (`server.plaintext: true` / `--plaintext` turns it off): Envoy AI Gateway
always speaks TLS to the picker, GIE's and llm-d's charts do by default. Certificate files are
re-read when they change (a rotated Kubernetes secret): gRPC asks before every new connection,
and a pair whose key does not match its certificate (a rotation caught half-way) is not taken.
"""

from __future__ import annotations

import datetime
import ipaddress
import logging
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from extproc.config import TLSSettings
from extproc.errors import ConfigError

log = logging.getLogger("extproc.tls")


@dataclass(frozen=True, slots=True)
class KeyPair:
    """PEM-encoded private key and certificate chain."""

    key_pem: bytes
    cert_pem: bytes


def self_signed(names: tuple[str, ...] = (), *, valid_days: int = 365) -> KeyPair:
    """An EC P-256 key and a certificate for `names` plus this host's name, `localhost` and
    127.0.0.1. A proxy can only use it without verification (or pinning this very cert):
    every start makes a new one."""
    key = ec.generate_private_key(ec.SECP256R1())
    dns = list(dict.fromkeys((*names, socket.gethostname(), "localhost")))
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, dns[0])])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        # Backdated a little: a proxy whose clock lags ours must not see "not yet valid".
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=valid_days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .sign(key, hashes.SHA256())
    )
    return KeyPair(
        key_pem=key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        ),
        cert_pem=cert.public_bytes(serialization.Encoding.PEM),
    )


def load_key_pair(settings: TLSSettings) -> KeyPair:
    """The key pair `settings` asks for. Raises ConfigError naming the unreadable file."""
    if settings.self_signed:
        return self_signed()
    assert settings.cert_file is not None and settings.key_file is not None  # __post_init__
    try:
        return KeyPair(
            key_pem=Path(settings.key_file).read_bytes(),
            cert_pem=Path(settings.cert_file).read_bytes(),
        )
    except OSError as exc:
        raise ConfigError(str(exc), path=("server", "tls")) from None


def server_credentials(pair: KeyPair) -> grpc.ServerCredentials:
    return grpc.ssl_server_credentials([(pair.key_pem, pair.cert_pem)])


def matches(pair: KeyPair) -> bool:
    """True when the private key belongs to the (first) certificate."""
    try:
        cert = x509.load_pem_x509_certificate(pair.cert_pem)
        key = serialization.load_pem_private_key(pair.key_pem, password=None)
    except ValueError:
        return False
    fmt = (serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return cert.public_key().public_bytes(*fmt) == key.public_key().public_bytes(*fmt)


class ReloadingCredentials:
    """Certificate files watched by their (mtime, size, inode): gRPC calls `fetch` before each
    new TLS connection; a changed, consistent pair replaces the served one. `reloads` counts
    the swaps, `rejected` the changed pairs refused (key and certificate do not match)."""

    def __init__(self, settings: TLSSettings) -> None:
        assert settings.cert_file is not None and settings.key_file is not None
        self._paths = (settings.cert_file, settings.key_file)
        self._lock = threading.Lock()  # gRPC may call fetch from its own threads
        self._seen = self._stamp()
        first = load_key_pair(settings)
        if not matches(first):
            raise ConfigError("private key does not match the certificate", path=("server", "tls"))
        self._settings = settings
        self.reloads = 0
        self.rejected = 0
        self.credentials = grpc.dynamic_ssl_server_credentials(
            self._config(first), self.fetch, require_client_authentication=False
        )

    def _stamp(self) -> tuple:
        out = []
        for p in self._paths:
            try:
                st = os.stat(p)
            except OSError:
                out.append(None)
            else:
                out.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(out)

    @staticmethod
    def _config(pair: KeyPair):
        return grpc.ssl_server_certificate_configuration([(pair.key_pem, pair.cert_pem)])

    def fetch(self):
        with self._lock:
            stamp = self._stamp()
            if stamp == self._seen or None in stamp:
                return None
            self._seen = stamp
            try:
                pair = load_key_pair(self._settings)
            except ConfigError as exc:
                log.warning("TLS certificate files changed but cannot be read: %s", exc)
                self.rejected += 1
                return None
            if not matches(pair):
                log.warning("TLS certificate files changed but the key does not match; kept old")
                self.rejected += 1
                return None
            self.reloads += 1
            log.info("TLS certificate reloaded from %s", self._paths[0])
            return self._config(pair)


def port_credentials(settings: TLSSettings) -> tuple[grpc.ServerCredentials, object | None]:
    """Credentials for the ext_proc port, and the reloader when certificate files are used."""
    if settings.self_signed:
        return server_credentials(self_signed()), None
    reloader = ReloadingCredentials(settings)
    return reloader.credentials, reloader
