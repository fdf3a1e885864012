"""Endpoint state: scraped figures plus age and in-flight counts, staleness by the clock."""

from __future__ import annotations

import pytest

from extproc.core import EndpointState
from extproc.endpoints.exposition import Scraped, parse_metrics
from extproc.endpoints.state import AbortCorrections, EndpointStates
from tests.index.conftest import ManualClock

A, B = "10.0.0.1:8000", "10.0.0.2:8000"
SCRAPED = Scraped(
    waiting=3,
    running=5,
    kv_usage=0.4,
    kv_block_size=16,
    kv_blocks=1000,
    max_adapters=2,
    running_adapters=frozenset({"sql"}),
    waiting_adapters=frozenset({"chat"}),
)


def test_never_scraped_endpoint_is_stale_with_no_age_and_carries_inflight() -> None:
    states = EndpointStates()
    assert states.state(A, 2, 300) == EndpointState(inflight_requests=2, inflight_tokens=300)
    assert states.is_stale(A) and states.age_s(A) is None and states.scraped(A) is None


def test_state_carries_scraped_figures_age_and_inflight() -> None:
    clock = ManualClock()
    states = EndpointStates(clock=clock)
    states.update(A, SCRAPED)
    clock.advance(0.05)
    assert states.state(A, inflight_requests=4, inflight_tokens=9000) == EndpointState(
        waiting=3,
        running=5,
        kv_usage=0.4,
        inflight_requests=4,
        inflight_tokens=9000,
        age_s=pytest.approx(0.05),
        is_stale=False,
        kv_block_size=16,
        kv_blocks=1000,
        max_adapters=2,
        running_adapters=frozenset({"sql"}),
        waiting_adapters=frozenset({"chat"}),
    )


def test_figures_turn_stale_after_the_threshold_and_fresh_on_update() -> None:
    clock = ManualClock()
    states = EndpointStates(stale_after_s=0.2, clock=clock)
    states.update(A, SCRAPED)
    clock.advance(0.19)
    assert not states.is_stale(A) and not states.state(A).is_stale
    clock.advance(0.02)
    assert states.is_stale(A) and states.state(A).is_stale
    assert states.state(A).waiting == 3  # stale figures are kept, their age says the rest
    states.update(A, Scraped(waiting=1))
    assert not states.is_stale(A) and states.state(A).waiting == 1


def test_retain_forgets_endpoints_that_left() -> None:
    states = EndpointStates()
    states.update(A, SCRAPED)
    states.update(B, SCRAPED)
    states.retain({B})
    assert A not in states and B in states and len(states) == 1


def test_stale_after_must_be_positive() -> None:
    with pytest.raises(ValueError, match="stale_after_s"):
        EndpointStates(stale_after_s=0)


def _engine(waiting: int, running: int, first: float, done: int, start: float = 1.0) -> Scraped:
    from extproc.core import LatencyTotals

    return Scraped(
        waiting=waiting,
        running=running,
        process_start_s=start,
        latency=LatencyTotals(ttft_count=first),
        finished=done,
    )


def test_prefilling_is_the_engines_requests_before_their_first_token() -> None:
    states = EndpointStates()
    # 10 first tokens, 7 finished: 3 of the 5 running decode; 2 waiting + 2 running prefill.
    states.update(A, _engine(waiting=2, running=5, first=10, done=7))
    assert states.state(A, 6, 9000).prefilling == 4
    # An engine exporting no first-token or finished counts: unknown, not 0.
    states.update(B, Scraped(waiting=2, running=5))
    assert states.state(B, 6, 9000).prefilling is None
    states.update(A, Scraped(waiting=2, running=5))
    assert states.state(A).prefilling is None


def test_aborts_before_a_first_token_are_added_back_once_seen_and_reset_on_restart() -> None:
    states = EndpointStates()
    # Idle, 2 requests finished without a first token (aborted in the queue).
    states.update(A, _engine(waiting=0, running=0, first=3, done=5))
    assert states.state(A).prefilling == 0
    # 4 more first tokens, none finished: 4 decode; the 2 aborts no longer hide two of them.
    states.update(A, _engine(waiting=1, running=4, first=7, done=5))
    assert states.state(A).prefilling == 1
    # Decoding never exceeds what runs (other clients' counts, or an abort mid-stream).
    states.update(A, _engine(waiting=0, running=1, first=9, done=5))
    assert states.state(A).prefilling == 0
    # A restarted engine starts its counts again: the old aborts no longer apply.
    states.update(A, _engine(waiting=0, running=3, first=2, done=0, start=2.0))
    assert states.state(A).prefilling == 1
    states.retain([B])
    states.update(B, _engine(waiting=1, running=0, first=0, done=0))
    assert states.state(A).prefilling is None and states.state(B).prefilling == 1


class _Engine:
    """An engine's counters, moved request by request, as its `/metrics` text. `cuts`: how
    it counts a request the client cut: "uncounted" (vLLM 0.32), "abort" (finished under
    that reason) or "stop" (finished under a reason that does not say so)."""

    def __init__(self, cuts: str) -> None:
        self.cuts = cuts
        self.first = 0
        self.finished = {"length": 0, "stop": 0, "abort": 0}
        self.waiting = 0
        self.prefilling = 0
        self.decoding = 0

    def scraped(self) -> Scraped:
        lines = [
            "process_start_time_seconds 1.0",
            f"vllm:num_requests_running{{engine=\"0\"}} {self.prefilling + self.decoding}",
            f"vllm:num_requests_waiting{{engine=\"0\"}} {self.waiting}",
            f"vllm:time_to_first_token_seconds_count{{engine=\"0\"}} {self.first}",
            f"vllm:time_to_first_token_seconds_sum{{engine=\"0\"}} {self.first * 0.1}",
            *(f'vllm:request_success_total{{engine="0",finished_reason="{r}"}} {n}'
              for r, n in self.finished.items()),
        ]  # fmt: skip
        return parse_metrics("\n".join(lines).encode() + b"\n")

    def start_prefill(self) -> None:
        self.prefilling += 1

    def first_token(self) -> None:
        self.prefilling -= 1
        self.decoding += 1
        self.first += 1

    def complete(self) -> None:
        self.decoding -= 1
        self.finished["length"] += 1

    def _cut(self) -> None:
        if self.cuts != "uncounted":
            self.finished[self.cuts] += 1

    def cut_before_first(self) -> None:
        self.prefilling -= 1
        self._cut()

    def cut_after_first(self) -> None:
        self.decoding -= 1
        self._cut()


def _overload(states: EndpointStates, eng: _Engine, rounds: int) -> list[int]:
    """Two requests always decode; each round two prefills start, one is cut before its
    first token, the other gets it, and every third round that one is cut mid-stream. Only
    one scrape in two finds nothing in prefill; the engine is never idle. Each scrape's
    error: the picker's count of requests before their first token less the truth."""
    for _ in range(2):
        eng.start_prefill()
        eng.first_token()
    errors = []

    def scrape() -> None:
        states.update(A, eng.scraped())
        got = states.state(A).prefilling
        assert got is not None
        errors.append(got - eng.prefilling - eng.waiting)

    for i in range(rounds):
        eng.start_prefill()
        eng.start_prefill()
        scrape()
        eng.cut_before_first()
        eng.first_token()
        if i % 3 == 0:
            eng.cut_after_first()
        else:
            eng.complete()
        scrape()
    return errors


@pytest.mark.parametrize("cuts", ["uncounted", "abort"])
def test_cuts_either_side_of_the_first_token_over_a_long_run_where_something_decodes(
    cuts: str, caplog
) -> None:
    # vLLM 0.32 counts no cut; an engine that counts them as `abort` reads the same (those
    # finishes are left out). Cuts before a first token then leave no trace; the ones after
    # it are learned at every scrape with nothing in prefill.
    states = EndpointStates()
    errors = _overload(states, _Engine(cuts), 200)
    # Exact at every scrape with nothing in prefill (the second of each round); between,
    # one cut mid-stream may not be seen yet (fewer in prefill by one), never the run's 67.
    assert errors[1::2] == [0] * 200, errors
    assert set(errors) <= {0, -1}, errors
    c = states.abort_corrections(A)
    assert c == AbortCorrections(counted_before_first=0, uncounted_after_first=67)
    # The degraded count is said once (rate-limited to a line a minute), naming the endpoint.
    said = [r.getMessage() for r in caplog.records if "cut after their first" in r.getMessage()]
    assert len(said) == 1 and A in said[0], said


def test_without_the_excess_bound_uncounted_cuts_would_hide_prefills_for_good() -> None:
    # Today's vLLM: after 200 rounds first - finished exceeds what runs by 67, which would
    # read every running request as decoding (0 in prefill while 2 are).
    states = EndpointStates()
    eng = _Engine("uncounted")
    _overload(states, eng, 200)
    eng.start_prefill()
    eng.start_prefill()
    s = eng.scraped()
    assert s.latency is not None and s.finished is not None
    assert s.latency.ttft_count - s.finished > s.running + s.waiting
    states.update(A, s)
    assert states.state(A).prefilling == 2


def test_counted_cuts_under_another_reason_are_learned_only_when_nothing_decodes() -> None:
    # An engine that counts a cut as finished without saying so: the deficit bound (exact
    # only when nothing decodes) is all there is; under the overload above it stays short
    # and the count errs towards more requests in prefill, never fewer.
    states = EndpointStates()
    errors = _overload(states, _Engine("stop"), 50)
    assert min(errors) >= 0 and errors[-1] > 0, errors
    c = states.abort_corrections(A)
    assert c is not None and c.uncounted_after_first == 0


def test_a_preempted_request_waiting_is_not_read_as_an_uncounted_cut() -> None:
    # 3 first tokens, none finished: 2 decode, 1 preempted back to the queue (vLLM).
    states = EndpointStates()
    states.update(A, _engine(waiting=1, running=2, first=3, done=0))
    c = states.abort_corrections(A)
    assert c is not None and c.uncounted_after_first == 0
