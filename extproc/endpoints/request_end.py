"""When a request really ends: in-flight placements held past the ext_proc stream.

With the response body not sent to the picker (our Envoy config: response_body_mode NONE),
the ext_proc stream ends at the response headers, long before a streamed reply is done, and
the request's in-flight count would vanish while the server is still decoding it. Envoy's
gRPC access log (`envoy.access_loggers.http_grpc`, batched) tells us when each request ended,
by `x-request-id`; until then the placement is held here. Per-request cost is one log entry,
whatever the output length.

Modes (`state.request_end`): `stream` releases at the ext_proc stream end (right when the
gateway streams response bodies through the picker: the stream end is the request end);
`access-log` always holds until the log entry; `auto` (default) holds once access-log
entries arrive (within `max_hold_s`) and most are for requests held here (a replica whose
gateway logs to other replicas, with no Redis to share entries, does not hold), so a
gateway without an access log is never starved of releases. A hold whose log entry never
comes is released after `max_hold_s` (counted in `expired`, logged): a lost log line cannot
leak a count forever.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Annotated, Literal

import msgspec

from extproc.endpoints.inflight import Placement

log = logging.getLogger("extproc.request_end")

Mode = Literal["auto", "stream", "access-log"]


class RequestEndSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """`mode`: see the module docstring. `max_hold_s`: the longest a placement waits for its
    access-log entry (above the gateway's route timeout). `max_held`: bound on held
    placements (the oldest is released first when exceeded)."""

    mode: Mode = "auto"
    max_hold_s: Annotated[float, msgspec.Meta(gt=0)] = 330.0
    max_held: Annotated[int, msgspec.Meta(gt=0)] = 200_000


# Why a response stopped short, from Envoy's response flags (server/access_log.py): the
# client hung up, the upstream reset or closed it, a timeout ended it, or the proxy itself
# reset it. The label values of `extproc_request_end_cut_total`.
CUT_REASONS = ("client", "upstream", "timeout", "proxy")


@dataclass(frozen=True, slots=True)
class Ended:
    """One finished request as the access log reports it. `ttfb_s` is the time from the
    request's start to the first upstream response byte (None when there was none). `cut`:
    why the response stopped short (one of `CUT_REASONS`), "" when it ran to its end or
    nothing says otherwise (an end another replica forwarded carries no status nor flags)."""

    request_id: str
    ttfb_s: float | None = None
    upstream: str = ""
    status: int | None = None  # the response status sent downstream
    response_bytes: int | None = None  # response body bytes sent downstream
    cut: str = ""

    @property
    def status_ok(self) -> bool:
        """A 2xx status, or none logged: nothing in the status says the request failed."""
        return self.status is None or 200 <= self.status < 300

    @property
    def completed(self) -> bool:
        """The response ran to its end with a 2xx status (or none logged). The status alone
        does not say it: Envoy logs the status it had already sent, so a client that hangs
        up mid-stream is logged with a 200, and only the flags tell it from a completion."""
        return self.status_ok and not self.cut


# Called once per hold: with its entry, or None when released without one (not held,
# expired, pushed out).
Late = Callable[[Ended | None], None]


@dataclass(slots=True)
class RequestEndStats:
    held: int = 0
    ended: int = 0  # holds released by their access-log entry
    expired: int = 0  # holds released by max_hold_s (or overflow): a lost entry
    entries: int = 0  # access-log entries received
    unmatched: int = 0  # entries for requests not held here
    # Entries whose status says complete (2xx, or none) but whose flags say the response
    # stopped short, by reason (`CUT_REASONS`): a client's hang-up, mostly.
    cut: dict[str, int] = field(default_factory=dict)


# Auto mode stops holding when more than this share of recent entries matched nothing here.
_SHARE_LIMIT = 0.3
_SHARE_STEP = 0.02
# Entries that arrive before their stream closed are remembered this long, at most this many.
_EARLY_S = 60.0
_EARLY_MAX = 10_000


class RequestEnds:
    """Holds placements until their request ends. Event-loop only (not thread-safe).

    `release` is the in-flight counter's release; `on_end` (optional) sees every matched end
    with its placement, e.g. to learn prefill speed."""

    def __init__(
        self,
        release: Callable[[Placement], None],
        settings: RequestEndSettings | None = None,
        *,
        on_end: Callable[[Placement, Ended], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings or RequestEndSettings()
        self.stats = RequestEndStats()
        self._release = release
        self._on_end = on_end
        self._clock = clock
        # Insertion order is deadline order.
        # request id -> (placement, deadline, what to tell when its entry comes).
        self._held: OrderedDict[str, tuple[Placement, float, Late | None]] = OrderedDict()
        self._early: OrderedDict[str, float] = OrderedDict()
        self._last_log: float | None = None
        self._warned = 0.0
        # Called with entries for requests not held here (another replica may hold them).
        self.on_unmatched: Callable[[Ended], None] | None = None
        # Moving share of received entries that matched nothing held here. High means the
        # gateway logs to several replicas: without sharing (on_unmatched), auto mode must
        # not hold, or other replicas' requests would stay counted until max_hold_s.
        self._unmatched_share = 0.0

    @property
    def holding(self) -> bool:
        """Whether a placement should wait for its access-log entry."""
        mode = self.settings.mode
        if mode == "stream":
            return False
        if mode == "access-log":
            return True
        last = self._last_log
        if last is None or self._clock() - last >= self.settings.max_hold_s:
            return False
        return self.on_unmatched is not None or self._unmatched_share < _SHARE_LIMIT

    def finish(self, request_id: str, placement: Placement, late: Late | None = None) -> None:
        """The ext_proc stream of `request_id` ended: release now, or hold until the log.
        `late` sees the entry when it comes (what the skipped response-header phase would
        have told: the served endpoint, the time to the first byte)."""
        now = self._clock()
        self.sweep(now)
        if not request_id or not self.holding or self._early.pop(request_id, None) is not None:
            self._release(placement)
            if late is not None:
                late(None)
            return
        previous = self._held.pop(request_id, None)
        if previous is not None:
            # The same id routed twice (a client reusing x-request-id): never leak the first.
            self._drop(previous)
        self._held[request_id] = (placement, now + self.settings.max_hold_s, late)
        if len(self._held) > self.settings.max_held:
            _, oldest = self._held.popitem(last=False)
            self.stats.expired += 1
            self._drop(oldest)
        self.stats.held = len(self._held)

    def ended(self, entry: Ended, *, forwarded: bool = False) -> bool:
        """An access-log entry: the request is over. `forwarded`: it came from another
        replica (not counted as received here, never forwarded again). Returns whether a
        placement held here was released."""
        now = self._clock()
        self._last_log = now  # forwarded ones too: the gateway logs, to another replica
        held = self._held.pop(entry.request_id, None)
        if not forwarded:
            self.stats.entries += 1
            if entry.cut and entry.status_ok:  # what the status alone called complete
                self.stats.cut[entry.cut] = self.stats.cut.get(entry.cut, 0) + 1
            miss = 1.0 if held is None else 0.0
            self._unmatched_share += _SHARE_STEP * (miss - self._unmatched_share)
        if held is None:
            if not forwarded:
                self.stats.unmatched += 1
                if self.on_unmatched is not None and entry.request_id:
                    self.on_unmatched(entry)
            if entry.request_id:
                # Its stream may not have closed yet (two gRPC streams, no ordering).
                self._early[entry.request_id] = now + _EARLY_S
                while len(self._early) > _EARLY_MAX:
                    self._early.popitem(last=False)
            return False
        self.stats.ended += 1
        self.stats.held = len(self._held)
        self._release(held[0])
        if self._on_end is not None:
            self._on_end(held[0], entry)
        if held[2] is not None:
            held[2](entry)
        return True

    def _drop(self, hold: tuple[Placement, float, Late | None]) -> None:
        """Release a hold whose entry never came."""
        self._release(hold[0])
        if hold[2] is not None:
            hold[2](None)

    def sweep(self, now: float | None = None) -> int:
        """Release holds past their deadline; returns how many."""
        now = self._clock() if now is None else now
        held, n = self._held, 0
        while held:
            rid, hold = next(iter(held.items()))
            if hold[1] > now:
                break
            del held[rid]
            self._drop(hold)
            n += 1
        early = self._early
        while early and next(iter(early.values())) <= now:
            early.popitem(last=False)
        if n:
            self.stats.expired += n
            self.stats.held = len(held)
            if now - self._warned > 10.0:
                self._warned = now
                log.warning(
                    "in-flight placements expired without an access-log entry",
                    extra={"expired": n, "expired_total": self.stats.expired},
                )
        return n
