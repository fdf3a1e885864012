"""The set of endpoints a picker may route to. Discovery (static list, file, Kubernetes)
replaces the set; readers take an immutable snapshot per request."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

from extproc.core import Endpoint
from extproc.errors import ConfigError


def parse_endpoints(spec: str) -> tuple[Endpoint, ...]:
    """`"10.0.0.1:8000,10.0.0.2:8000"` -> endpoints. Addresses must be literal `ip:port`
    (IPv6 as `[::1]:8000`) because that is what Envoy's ORIGINAL_DST accepts."""
    out: list[Endpoint] = []
    for raw in spec.split(","):
        item = raw.strip()
        if item:
            out.append(Endpoint(address=normalize_address(item)))
    if len(set(out)) != len(out):
        raise ConfigError("--endpoints: duplicate address")
    return tuple(out)


def normalize_address(item: str) -> str:
    host, sep, port = item.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConfigError(f"endpoint {item!r}: expected ip:port")
    bracketed = host.startswith("[") and host.endswith("]")
    try:
        ip = ipaddress.ip_address(host[1:-1] if bracketed else host)
    except ValueError:
        raise ConfigError(f"endpoint {item!r}: host must be an IP address") from None
    return f"[{ip}]:{int(port)}" if ip.version == 6 else f"{ip}:{int(port)}"


class EndpointPool:
    """Current endpoints. `replace` swaps the whole set atomically (one attribute write), so
    a request scheduling concurrently sees either the old set or the new one."""

    def __init__(self, endpoints: Iterable[Endpoint] = ()) -> None:
        self._endpoints: tuple[Endpoint, ...] = tuple(endpoints)
        self._by_address = {e.address: e for e in self._endpoints}

    def replace(self, endpoints: Iterable[Endpoint]) -> None:
        eps = tuple(endpoints)
        self._by_address = {e.address: e for e in eps}
        self._endpoints = eps

    def snapshot(self) -> tuple[Endpoint, ...]:
        return self._endpoints

    def get(self, address: str) -> Endpoint | None:
        return self._by_address.get(address)

    def __len__(self) -> int:
        return len(self._endpoints)
