"""What guards the ext_proc port before a message reaches the stream state machine: which
peers may open streams (an optional address allow-list), and what happens to bytes that are
not a ProcessingRequest (one rate-limited log line, not a traceback per message).

The allow-list is checked against the gRPC peer, i.e. the proxy's address, so it names the
Envoy pods (or their network), not end users. TLS on the port is separate (`server.tls`).
"""

from __future__ import annotations

import ipaddress
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from google.protobuf.message import DecodeError

from extproc.server import wire

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


@dataclass(slots=True)
class Throttle:
    """At most one log line per `every_s` per key; counts what it suppressed in between so
    the next line says how many there were."""

    every_s: float = 10.0
    _last: dict[str, float] = field(default_factory=dict)
    _suppressed: dict[str, int] = field(default_factory=dict)

    def allow(self, key: str) -> int | None:
        """None: stay quiet. Else: log now; the value is how many were suppressed before."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self.every_s:
            self._suppressed[key] = self._suppressed.get(key, 0) + 1
            return None
        if len(self._last) > 1024:  # keys are few (reasons); never let them grow unbounded
            self._last.clear()
            self._suppressed.clear()
        self._last[key] = now
        return self._suppressed.pop(key, 0)


def lenient_deserializer(data: bytes) -> wire.ProcessingRequest | None:
    """ProcessingRequest.FromString, but undecodable bytes give None (the handler ends the
    stream with INVALID_ARGUMENT) instead of an exception grpc logs with a traceback."""
    try:
        return wire.ProcessingRequest.FromString(data)
    except (DecodeError, RuntimeWarning, ValueError):
        return None
