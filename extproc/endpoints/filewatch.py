"""Endpoint discovery from a file, for plain Envoy without Kubernetes: a YAML or JSON list of
endpoints, re-read when it changes. A bad edit keeps the last good set (and says why).

    - 10.0.0.1:8000
    - {address: 10.0.0.2:8000, name: gpu-2, labels: {llm-d.ai/role: prefill}}
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import msgspec
import yaml

from extproc.core import Endpoint
from extproc.endpoints.pool import normalize_address
from extproc.errors import ConfigError

log = logging.getLogger(__name__)

OnChange = Callable[[tuple[Endpoint, ...]], None]

# An endpoint list is a few KiB; past this the file is not what we think it is.
_MAX_FILE_BYTES = 4 << 20


class _Entry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    address: str
    name: str = ""
    labels: dict[str, str] = msgspec.field(default_factory=dict)


def parse_endpoint_file(text: str, source: str = "endpoints file") -> tuple[Endpoint, ...]:
    """The endpoints a file lists (YAML, so JSON too): strings `ip:port` or mappings
    `{address, name?, labels?}`. Raises ConfigError naming the entry that is wrong."""
    try:
        doc = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{source}: {exc}") from None
    if doc is None:
        doc = []
    if not isinstance(doc, list):
        raise ConfigError(f"{source}: expected a list of endpoints")
    out: list[Endpoint] = []
    seen: set[str] = set()
    for i, item in enumerate(doc):
        where = f"{source}[{i}]"
        entry = _entry(item, where)
        try:
            address = normalize_address(entry.address.strip())
        except ConfigError as exc:
            raise ConfigError(f"{where}: {exc}") from None
        if address in seen:
            raise ConfigError(f"{where}: duplicate address {address}")
        seen.add(address)
        out.append(Endpoint(address, entry.name, MappingProxyType(dict(entry.labels))))
    return tuple(out)


def _entry(item: Any, where: str) -> _Entry:
    if isinstance(item, str):
        return _Entry(item)
    try:
        return msgspec.convert(item, _Entry)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_endpoint_file(path: str | Path) -> tuple[Endpoint, ...]:
    """Read and parse once (startup: fail fast on a bad file)."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            data = f.read(_MAX_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{path}: {exc.strerror or exc}") from None
    if len(data) > _MAX_FILE_BYTES:
        raise ConfigError(f"{path}: larger than {_MAX_FILE_BYTES} bytes")
    return parse_endpoint_file(data.decode("utf-8", errors="replace"), str(path))


def _identity(endpoints: tuple[Endpoint, ...]) -> tuple[tuple[Any, ...], ...]:
    # Endpoint equality ignores labels; a role change must still be delivered.
    return tuple((e.address, e.name, tuple(sorted(e.labels.items()))) for e in endpoints)


@dataclass(slots=True)
class FileWatchStats:
    """Counters since start: passes that found the endpoints file missing, unreadable or
    invalid (`failures`; the last good set stays)."""

    failures: int = 0


class EndpointFileWatch:
    """Background loop: polls `path` every `interval_s` and calls `on_change` with the new
    set when the file's identity (inode, size, mtime) changed and its endpoints differ.

    Polling (not inotify) also sees a Kubernetes ConfigMap update, which swaps a symlink
    rather than writing the file. The first pass delivers the current set; a missing or bad
    file is logged, counted in `stats.failures` (on /metrics), and the last good set stays.
    Runs until cancelled.
    """

    def __init__(
        self,
        path: str | Path,
        on_change: OnChange,
        *,
        interval_s: float = 1.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.path = Path(path)
        self.interval_s = interval_s
        self.stats = FileWatchStats()
        self.synced = asyncio.Event()
        self._on_change = on_change
        self._sleep = sleep
        self._stamp: tuple[int, int, int, int] | None = None
        self._last: tuple[tuple[Any, ...], ...] | None = None

    async def run(self) -> None:
        while True:
            self.check()
            await self._sleep(self.interval_s)

    def check(self) -> None:
        """One pass: stat, and re-read only when the file changed."""
        try:
            st = os.stat(self.path)
        except OSError as exc:
            if self._stamp != (0, 0, 0, 0):
                self.stats.failures += 1
                log.warning("endpoints file %s: %s; keeping the last set", self.path, exc)
            self._stamp = (0, 0, 0, 0)
            return
        stamp = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
        if stamp == self._stamp:
            return
        self._stamp = stamp
        try:
            endpoints = load_endpoint_file(self.path)
        except ConfigError as exc:
            self.stats.failures += 1
            log.warning("endpoints file rejected, keeping the last set: %s", exc)
            return
        key = _identity(endpoints)
        if key != self._last:
            self._last = key
            log.info("endpoints file %s: %d endpoint(s)", self.path, len(endpoints))
            self._on_change(endpoints)
        self.synced.set()
