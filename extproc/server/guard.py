"""What guards the ext_proc port before a message reaches the stream state machine: which
peers may open streams (an optional address allow-list), and what happens to bytes that are
not a ProcessingRequest (one rate-limited log line, not a traceback per message).

The allow-list is checked against the gRPC peer, i.e. the proxy's address, so it names the
Envoy pods (or their network), not end users. TLS on the port is separate (`server.tls`).
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Sequence
from dataclasses import dataclass

from google.protobuf.message import DecodeError

from extproc.server import wire
from extproc.throttle import Throttle

__all__ = ["PeerAllowList", "Throttle", "lenient_deserializer", "peer_ip"]

log = logging.getLogger("extproc.guard")

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def peer_ip(peer: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    """gRPC's peer string (`ipv4:10.0.0.1:5000`, `ipv6:[::1]:5000`, `unix:...`) -> its IP."""
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        host = rest.rpartition(":")[0]
    elif kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]").split("%", 1)[0]
    else:
        return None
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class PeerAllowList:
    """Addresses allowed to open ext_proc streams; empty = anyone who can connect."""

    networks: tuple[_Network, ...] = ()

    @classmethod
    def parse(cls, cidrs: Sequence[str]) -> PeerAllowList:
        """`10.0.0.0/8`, `192.168.1.7`, `::1` ... ; raises ValueError for anything else."""
        return cls(tuple(ipaddress.ip_network(c.strip(), strict=False) for c in cidrs))

    def allows(self, peer: str) -> bool:
        if not self.networks:
            return True
        ip = peer_ip(peer)
        if ip is None:
            return False  # unix sockets and unknown transports: not on any list
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return any(ip.version == n.version and ip in n for n in self.networks)


def lenient_deserializer(data: bytes) -> wire.ProcessingRequest | None:
    """ProcessingRequest.FromString, but undecodable bytes give None (the handler ends the
    stream with INVALID_ARGUMENT) instead of an exception grpc logs with a traceback."""
    try:
        return wire.ProcessingRequest.FromString(data)
    except (DecodeError, RuntimeWarning, ValueError):
        return None
