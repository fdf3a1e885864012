"""Endpoint state: scraped figures plus age and in-flight counts, staleness by the clock."""

from __future__ import annotations

import pytest

from extproc.core import EndpointState
from extproc.endpoints.exposition import Scraped
from extproc.endpoints.state import EndpointStates
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
