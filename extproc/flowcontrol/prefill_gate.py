"""`prefill-gate`: a lower band's request starts on a server only while that server's
unfinished prefill work stays short, as long as a higher band is sending work; a higher
band's request goes to the server with the least unfinished prefill.

Why: an engine cannot shorten a prefill under way. vLLM's scheduler (and the simulator's
steps, extproc/sim/steps.py) gives each step's token budget to running prefills first, then
to waiting ones in arrival (or priority) order; a waiting request never takes budget from
a running one. So an interactive request's time to first token is its own prefill plus
all the prefill work its server had not finished when it arrived (FCFS), or at least the
prefills already under way (priority scheduling). In the overload bench (bench/RESULTS.md,
eleventh session) the slowest admitted interactive requests were exactly that: 0.4-0.8 s
of waiting for, and sharing steps with, batch prefills on a server whose KV had room.
KV room (per-endpoint admission, the reserve) does not bound this wait; this gate does:
with at most `maxPrefillTokens` of unfinished prefill on a server after a lower-band
request is released to it, a higher-band request arriving there waits at most about that
much prefill (a server with nothing in prefill always takes one request, whatever its
size, or a long prompt would never start).

"Unfinished" is counted per server from the engine's own figure, fresh at every scrape:
how many of its requests are before their first token (`EndpointState.prefilling`,
endpoints/state.py). The engine starts prefills in arrival order, so those are the
youngest this picker placed there; their sizes are the picker's uncached-prompt
estimates, and the picker's placements since shortly before that scrape count whole (the
engine may not have seen them). Requests beyond this picker's own (other replicas') count
at the mean size of its own. A late scrape is still used (what was placed since counts
whole); a server whose count is missing, or older than 2 s, is judged by all its in-flight
prompt tokens (decoding ones too: it holds back more, never less), counted in `blind` and
logged once.

Fleet view (`fleetView`, with replicas sharing flow state through Redis,
flowcontrol/shared.py): each replica publishes, per server, its placements it has not yet
seen finish their prefill (each one's age and uncached prompt tokens), and counts the
peers' with its own, in one arrival order, against the engine's count. Without it a
replica sees only the engine's count beyond its own placements, at the mean size of its
own: a peer's long prompt counted as one of this replica's short ones, and both replicas
steered interactive work to the same server by their own counts (bench/RESULTS.md,
eleventh session, m6). A peer's placement is dated by its age when the peer published it
(up to one exchange interval before this replica read it: dated late, it counts whole a
little longer, holding back more, never less). Redis failing: the peers' placements are
dropped (per-replica view, as without the fleet view), logged once per outage, and
`peer_view` says so (the `extproc_flow_prefill_gate_fleet_view` gauge).

"Sending work": a higher band is active for `activeWindow` after its last arrival here.
Outside that window the gate does not hold (a batch-only pool runs at full speed).
`activeAtStart` (by default on wherever it applies): every band above the lowest that has a
`reserve_prior` (the operator said it sends work) counts as arrived when the controller
starts, so the gate holds from the picker's start for one window. Why: before the first
interactive arrival nothing gated batch, and 6-12 batch requests (6-8k prompt tokens) went
to each server in the burst's first 0.8 s; the run's first or second interactive request,
arriving 0.27-0.95 s in, then waited 0.33-0.84 s in the engine's prefill queue behind them
alone (2.0-3.0x the unloaded p99: 6 of 23 slow interactive requests over seeds 15-27;
bench/RESULTS.md, issue 15).

Held requests wait in the picker's queue (their band's TTL applies); `held` counts the
dispatch opportunities where some server had KV room for the request but the gate kept it.
"""

from __future__ import annotations

import collections
import heapq
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Annotated

import msgspec

from extproc.core import EndpointState

log = logging.getLogger("extproc.flowcontrol")

# A placement made less than this before a scrape may not be in the engine's count: the
# way to the engine (Envoy, the HTTP hop) and the scrape's own age at arrival. Found behind
# Envoy: a long prompt placed just before a scrape that did not show it yet read as done,
# and a batch request was released behind it (tests/e2e/test_flow_prefill_gate.py).
_SEEN_AFTER_S = 0.2
# A scrape older than this is not used at all (the server is judged blind).
_BLIND_AFTER_S = 2.0
# Older than the scrape by more than this, a placement has surely reached the engine
# (well over the way there even on a loaded machine); only then may the count retire it.
_TRANSIT_S = 0.5
# Placements published per server (the youngest): the ones that can still be unfinished.
# A server's engine runs far fewer prefills than this at once.
_PUBLISHED_MAX = 64
# Placements kept per server. Only a judgement retires them, and none happens while no
# higher band is active and nothing is steered (a batch-only pool): without a bound they
# grew with every placement. The oldest beyond this are long done, or if not, counted
# by the engine's figure at the mean size of the known ones.
_KEPT_MAX = 256


@dataclass(slots=True)
class _Placed:
    at: float  # when it was released (monotonic seconds)
    tokens: int  # its uncached prompt, as the picker estimates it
    address: str  # where it was released to, then where the router placed it


class PrefillGate:
    """See the module docstring. One instance per controller; event loop only."""

    type_name = "prefill-gate"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        # Unfinished prefill (picker tokens) a server may hold once a lower-band request is
        # released to it, while a higher band is active. vLLM's default step budget on CPU
        # and GPUs below 70 GiB (max_num_batched_tokens) is 2048: about one step's wait.
        maxPrefillTokens: Annotated[int, msgspec.Meta(gt=0)] = 2048
        # A higher band counts as active this long after its last arrival (Go duration).
        activeWindow: str = "10s"
        # A higher band's request goes to the servers with the least unfinished prefill
        # (among those with KV room); this overrides prefix affinity for that band.
        steerHigherBands: bool = True
        # With flow state shared through Redis: count the other replicas' placements not
        # yet seen to finish their prefill with their own sizes and times (module docstring).
        fleetView: bool = False
        # Bands above the lowest with a reserve_prior count as arrived at the controller's
        # start: the gate holds from the start for one activeWindow (module docstring).
        # Unset: on where such a band exists; true: the same, said at start where none does.
        activeAtStart: bool | None = None

    def __init__(
        self, params: Params | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        from extproc.flowcontrol.config import parse_duration  # config imports this module

        self.params = params or self.Params()
        self.window_s = parse_duration(self.params.activeWindow)
        self.max_tokens = self.params.maxPrefillTokens
        self.steers = self.params.steerHigherBands
        self.fleet_view = self.params.fleetView
        self._clock = clock
        self._last: dict[int, float] = {}  # band -> its last arrival
        self._own: dict[str, collections.deque[_Placed]] = {}
        self._unplaced: dict[object, _Placed] = {}  # ticket -> its entry, until placed
        self.held = 0
        self.blind = 0
        self.last_unfinished: dict[str, float] = {}  # address -> tokens, last evaluation
        self._warned_blind = False
        self._told_held = False
        # The peers' placements per server (at, tokens), oldest first, from the last
        # exchange; `peer_view`: that exchange worked (None: no exchange yet).
        self._peers: dict[str, list[tuple[float, int]]] = {}
        self.peer_view: bool | None = None

    def use_clock(self, clock: Callable[[], float]) -> None:
        """The controller's clock (tests drive it by hand)."""
        self._clock = clock

    # -- what flows through the controller -------------------------------------------------

    def started(self, bands: Iterable[int], lowest: int | None) -> None:
        """The controller starts: with `activeAtStart` (unless false), `bands` above `lowest`
        (those the operator gave a prior) count as arrived now."""
        if self.params.activeAtStart is False:
            return
        above = sorted(p for p in bands if lowest is not None and p > lowest)
        if not above:
            if self.params.activeAtStart is None:
                return  # the default, where it does not apply: nothing to say
            log.warning(
                "prefill-gate: activeAtStart has no effect: no band above the lowest has a "
                "flow_control.reserve_prior"
            )
            return
        now = self._clock()
        for p in above:
            self._last.setdefault(p, now)
        log.info(
            "prefill-gate: bands %s count as active from the start (activeAtStart, %.0f s)",
            ", ".join(map(str, above)),
            self.window_s,
        )

    def arrived(self, priority: int) -> None:
        self._last[priority] = self._clock()

    def active_above(self, priority: int) -> bool:
        """Whether a band above `priority` sent work within the window."""
        now = self._clock()
        return any(p > priority and now - t <= self.window_s for p, t in self._last.items())

    def released(self, ticket: object, address: str, prompt_tokens: int) -> None:
        """A request released towards `address` (the controller's target; "" = anywhere:
        not counted until placed)."""
        entry = _Placed(self._clock(), max(0, prompt_tokens), address)
        self._unplaced[ticket] = entry
        if address:
            q = self._own.setdefault(address, collections.deque())
            q.append(entry)
            _bound(q)

    def placed(self, ticket: object, address: str) -> None:
        """The router placed it on `address` (possibly another endpoint than its target)."""
        entry = self._unplaced.pop(ticket, None)
        if entry is None or not address or entry.address == address:
            return
        if entry.address:
            q = self._own.get(entry.address)
            if q is not None and entry in q:  # (retired already: nothing to move)
                q.remove(entry)
        entry.address = address
        q = self._own.setdefault(address, collections.deque())
        # Kept in release order: the engine retires the oldest first.
        i = len(q)
        while i > 0 and q[i - 1].at > entry.at:
            i -= 1
        q.insert(i, entry)
        _bound(q)

    def forget(self, ticket: object) -> None:
        """The ticket ended without the router placing it."""
        entry = self._unplaced.pop(ticket, None)
        if entry is not None and entry.address:
            q = self._own.get(entry.address)
            if q is not None and entry in q:
                q.remove(entry)

    # -- the fleet view (flowcontrol/shared.py carries it) ----------------------------------

    def published(self) -> dict[str, list[list[int]]]:
        """This replica's placements not yet seen to finish their prefill, per server:
        [age ms, uncached prompt tokens], the youngest `_PUBLISHED_MAX`, oldest first."""
        now = self._clock()
        out: dict[str, list[list[int]]] = {}
        for address, q in self._own.items():
            if q:
                young = list(q)[-_PUBLISHED_MAX:]
                out[address] = [[max(0, round((now - e.at) * 1000)), e.tokens] for e in young]
        return out

    def peers_placed(self, placements: Mapping[str, Iterable[tuple[float, int]]]) -> None:
        """The peers' published placements per server, as (age s, tokens), now."""
        now = self._clock()
        self._peers = {
            a: sorted((now - max(0.0, age), max(0, int(t))) for age, t in items)
            for a, items in placements.items()
        }
        if self.peer_view is False:
            log.info("prefill-gate: the other replicas' placements are known again")
        self.peer_view = True

    def peer_counts(self) -> dict[str, int]:
        """The peers' placements known per server (last exchange)."""
        return {a: len(items) for a, items in self._peers.items()}

    def peers_lost(self) -> None:
        """The exchange failed: per-replica view until it works again (said once)."""
        self._peers = {}
        if self.peer_view is not False:
            log.warning(
                "prefill-gate: the other replicas' placements are unknown (shared flow state "
                "failing); counting the engine's figure beyond this replica's own at their "
                "mean size until it returns"
            )
        self.peer_view = False

    # -- the judgement ---------------------------------------------------------------------

    def unfinished(self, address: str, state: EndpointState) -> float:
        """Prefill tokens `address` has not finished, as the picker can tell now."""
        now = self._clock()
        q = self._own.get(address)
        peers = self._peers.get(address, ())
        n = state.prefilling
        # A scrape older than the detectors' staleness bound still counts: everything
        # placed since shortly before it counts whole, so an old count only holds back
        # more. Judged blind on every stale scrape, each late scrape on a loaded machine
        # counted every in-flight prompt token (mostly decoding requests') and held batch.
        if n is None or state.age_s is None or state.age_s > _BLIND_AFTER_S:
            self.blind += 1
            if not self._warned_blind:
                self._warned_blind = True
                log.warning(
                    "prefill-gate: %s gives no fresh first-token and finished counts "
                    "(vllm:time_to_first_token_seconds, vllm:request_success_total); its "
                    "in-flight prompt tokens count as unfinished prefill",
                    address,
                )
            unplaced = sum(e.tokens for e in q or () if e.at > now - _TRANSIT_S)
            unplaced += sum(t for at, t in peers if at > now - _TRANSIT_S)
            total = float(state.inflight_tokens + unplaced)
            self.last_unfinished[address] = total
            return total
        scraped_at = now - state.age_s
        # The placements known there, ours (with their entries, to retire) and the peers',
        # in one arrival order: the engine starts prefills in arrival order, whoever placed
        # them.
        known: Iterable[tuple[float, int, _Placed | None]] = ((e.at, e.tokens, e) for e in q or ())
        if peers:
            known = heapq.merge(known, ((at, t, None) for at, t in peers), key=lambda k: k[0])
        total = 0.0
        older: list[tuple[float, int, _Placed | None]] = []  # surely in the engine's count
        for k in known:
            if k[0] > scraped_at - _SEEN_AFTER_S:
                # Maybe not in the engine's count yet: unfinished, counted whole.
                total += k[1]
            else:
                older.append(k)
        # Of the older ones the engine's `n` unfinished are the youngest (`n` may include
        # some of the recent ones too: counted twice then, for at most _SEEN_AFTER_S;
        # holding back, never less). The rest are done; ours among them are retired once
        # surely arrived, so a late arrival is not retired in place of an earlier one.
        done = max(0, len(older) - n)
        total += sum(t for _, t, _ in older[done:])
        for at, _, e in older[:done]:
            if e is None:
                continue  # a peer's: it retires its own
            if q is None or at >= scraped_at - _TRANSIT_S or q[0] is not e:
                break
            q.popleft()
        if n > len(older):
            # Nobody's this picker knows of (another replica's, without the fleet view): at
            # the mean size of the known ones, else of what is in flight there.
            left = len(q or ()) + len(peers)
            if left:
                mean = (sum(e.tokens for e in q or ()) + sum(t for _, t in peers)) / left
            elif state.inflight_requests:
                mean = state.inflight_tokens / state.inflight_requests
            else:
                mean = float(self.max_tokens)
            total += (n - len(older)) * mean
        self.last_unfinished[address] = total
        return total

    def admits(self, unfinished: float, prompt_tokens: int) -> bool:
        """Whether a lower-band request of `prompt_tokens` may start where `unfinished`
        prefill tokens are left (always where nothing is)."""
        return unfinished <= 0 or unfinished + prompt_tokens <= self.max_tokens

    def note_held(self, priority: int) -> None:
        self.held += 1
        if not self._told_held:
            self._told_held = True
            log.info(
                "prefill-gate: holding band %d's requests while servers finish prefill "
                "(a higher band is active; at most %d unfinished prefill tokens per server)",
                priority,
                self.max_tokens,
            )


def _bound(q: collections.deque[_Placed]) -> None:
    while len(q) > _KEPT_MAX:
        q.popleft()
