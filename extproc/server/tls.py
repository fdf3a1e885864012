"""Server credentials for the ext_proc port: PEM files from `server.tls`, or a key and
self-signed certificate generated in memory at start (nothing written to disk)."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from dataclasses import dataclass
from pathlib import Path

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from extproc.config import TLSSettings
from extproc.errors import ConfigError


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
