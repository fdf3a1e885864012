"""What flow control hands out and counts: the request as admission sees it
(`FlowRequest`), the admitted request's `Ticket` (released when it ends, or evicted while
running), the band limits, the shed reasons (`FlowRejected`, with llm-d's
`x-llm-d-request-dropped-reason` values) and the outcome counters (`FlowStats`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# Reasons, as llm-d spells them in `x-llm-d-request-dropped-reason`.
REJECTED_SATURATED = "rejected-saturated"
REJECTED_TTL = "rejected-ttl-expired"
EVICTED_PRESSURE = "evicted-queue-pressure"

MAX_LABELLED_FLOWS = 256

OUTCOMES = (
    "dispatched",
    "rejected_capacity",
    "evicted_ttl",
    "evicted_pressure",
    "cancelled",
    "evicted_inflight",
)


class FlowRejected(Exception):
    """The request is shed: `reason` is the dropped-reason header value."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class FlowRequest:
    """What admission needs: who (fairness ID), how urgent (priority), how big (tokens for
    fairness: uncached prompt + expected output; bytes for the queue bound)."""

    fairness_id: str
    priority: int
    tokens: int
    body_bytes: int
    slo_ttft_s: float | None = None
    output_tokens: int = 0  # the expected output part of `tokens`
    # What the engine will hold for it, in the detector's unit (count_engine_blocks,
    # flowcontrol/engine_blocks.py); 0: not counted so, `counted_tokens` stand for it.
    engine_tokens: int = 0
    # Whether what it takes on a server counts its output: as the saturation detector
    # counts it once placed. The controller sets it at admission (`FlowController.admit`);
    # see `counted_tokens`.
    output_counted: bool = True

    @property
    def prompt_tokens(self) -> int:
        return self.tokens - self.output_tokens

    @property
    def counted_output(self) -> int:
        """The output part of `counted_tokens`."""
        return self.output_tokens if self.output_counted else 0

    @property
    def counted_tokens(self) -> int:
        """What it takes on a server by its tokens, in the detector's unit. Once placed a
        request is counted by the detector (its in-flight prompt tokens, plus its output
        where the detector counts one: the concurrency detector's `outputTokens`, the
        utilization detector's scraped KV); until then the controller counts it as pending,
        claimed, reserved and, at its end, freed. One unit for both: with a concurrency
        detector without `outputTokens` a placed request counted its prompt alone while a
        request asking for room (and the pending figures, the reserve, the refill credit)
        counted prompt + output, so a request shrank by its output at placement and the
        room freed at its end was credited its output too (twenty-third session). The
        detector's unit is the one that is right: it is what the operator's ceiling
        (`maxTokenConcurrency`) was set against, and what every placed request is counted
        in; `tokens` stays prompt + output for fairness, which charges service."""
        return self.prompt_tokens + self.counted_output

    @property
    def room_tokens(self) -> int:
        """What it takes on a server, for the room checks (what its engine holds, counting
        engine blocks)."""
        return self.engine_tokens or self.counted_tokens


@dataclass(eq=False, slots=True)
class Ticket:
    """An admitted request, until `release`. `placed` once the router counted it in flight
    (from then on the detector sees it through in-flight counts, not as pending)."""

    request: FlowRequest
    waited_s: float = 0.0
    placed: bool = False
    released: bool = False
    pending: bool = True  # counted in the controller's pending figures
    # Per-endpoint admission: the endpoints with room for it when released (the router
    # places it on one of them; empty = anywhere) and the one its pending work is counted
    # against until placed (the one with the most room).
    endpoints: frozenset[str] = frozenset()
    target: str = ""
    # Where the router placed it, when the controller counts its own output there, and what
    # it added to that server's count beyond the detector's figures (given back at its end):
    # its own output against the detector's constant, and (count_engine_blocks) what its
    # engine holds beyond that.
    placed_at: str = ""
    counted_extra: int = 0
    counted_blocks: int = 0
    # Where the router placed it, while its end is still to be counted as room that
    # server freed (flowcontrol/refill.py).
    freed_at: str = ""
    # In-flight eviction (flowcontrol/eviction.py): whether this one may be cut, when it
    # started, whether it was cut, and who cuts it (the ext_proc stream, once routed).
    evictable: bool = False
    dispatched_at: float = 0.0
    # Where the router placed it (per-endpoint eviction cuts the requests of one endpoint).
    endpoint: str = ""
    evicted: bool = False
    # When an evictable one stopped being cuttable (its stream ended), until its end.
    uncut_since: float = 0.0
    _on_evict: Callable[[], None] | None = None

    def evict(self) -> None:
        self.evicted = True
        if self._on_evict is not None:
            self._on_evict()

    def on_evict(self, fn: Callable[[], None]) -> None:
        """Call `fn` when the request is evicted (at once if it already was)."""
        self._on_evict = fn
        if self.evicted:
            fn()


@dataclass(frozen=True, slots=True)
class BandLimits:
    priority: int
    max_requests: int = 5000
    max_bytes: int = 1_000_000_000


@dataclass(slots=True)
class FlowStats:
    """Counters by (priority, fairness ID, outcome) and wait sums by (priority, fairness ID)."""

    outcomes: dict[tuple[int, str, str], int] = field(default_factory=dict)
    wait_sum: dict[tuple[int, str], float] = field(default_factory=dict)
    wait_count: dict[tuple[int, str], int] = field(default_factory=dict)
    wait_max: dict[int, float] = field(default_factory=dict)

    flows: set[str] = field(default_factory=set)

    def label(self, fairness_id: str) -> str:
        """Fairness IDs come from clients: past `MAX_LABELLED_FLOWS` distinct ones, the rest
        are counted together as "other" (bounded memory and metric cardinality)."""
        if fairness_id in self.flows:
            return fairness_id
        if len(self.flows) < MAX_LABELLED_FLOWS:
            self.flows.add(fairness_id)
            return fairness_id
        return "other"

    def count(self, req: FlowRequest, outcome: str) -> None:
        k = (req.priority, self.label(req.fairness_id), outcome)
        self.outcomes[k] = self.outcomes.get(k, 0) + 1
