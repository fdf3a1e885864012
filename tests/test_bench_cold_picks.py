"""bench/cold_picks.py: the scorer's own rule for a new prefix, and a repeat pick sorted by
whether the deciding replica's LRU knew the earlier pick, on hand-made trace rows."""

from __future__ import annotations

import pytest

from extproc.core import Candidate, Endpoint, EndpointState
from extproc.scheduling.plugins.prefix import NoHitLRUScorer
from tests.bench_modules import bench_modules

LRU = "default/no-hit-lru-scorer"


@pytest.fixture(scope="module")
def cp():
    with bench_modules("cold_picks") as (module,):
        yield module


@pytest.mark.parametrize(
    "blocks",
    [[0, 0, 0], [2, 0, 0], [2, 2, 0], [2, 2, 2], [3, 2, 2], [1, 1], [1, 0]],
)
def test_new_prefix_is_the_scorers_own_rule(cp, blocks):
    cands = [
        Candidate(Endpoint(f"s{i}"), EndpointState(), prefix_blocks=float(b))
        for i, b in enumerate(blocks)
    ]
    prefix = {f"s{i}": float(b) for i, b in enumerate(blocks) if b}
    assert cp.is_cold([c.endpoint.address for c in cands], prefix) is NoHitLRUScorer._is_cold(cands)


def _row(t: float, replica: int, to: str, lru: dict[str, float]) -> dict:
    return {
        "sent_s": t,
        "decision": {
            "picker": replica,
            "endpoints": [to],
            "prefix_blocks": {},
            "scores": {LRU: lru},
        },
    }


def test_a_repeat_is_unknown_when_the_peers_pick_had_not_arrived(cp):
    rows = [
        _row(0.00, 1, "s0", {"s0": 1.0, "s1": 1.0, "s2": 1.0}),
        # Replica 2, 10 ms later, knows nothing of s0's pick: s0 again, s1 and s2 untouched.
        _row(0.01, 2, "s0", {"s0": 1.0, "s1": 1.0, "s2": 1.0}),
        # Replica 3, 100 ms later, knows s0's picks (score under 1.0) and goes to s1.
        _row(0.10, 3, "s1", {"s0": 0.0, "s1": 1.0, "s2": 1.0}),
        # Replica 1 knows s0 (its own) and s1; the other scorers send it to s0 anyway.
        _row(0.20, 1, "s0", {"s0": 0.0, "s1": 0.9, "s2": 1.0}),
    ]
    res = cp.analyse(rows, [1.0])
    w = res["windows"][1.0]
    assert w["cold"] == 4 and w["per_server"] == [3, 1, 0]
    assert w["repeats"] == {"unknown": 1, "own": 1}
    assert w["unknown_repeat_ages"] == pytest.approx([0.01])
    # Single picks by a peer, by age: s0's at replica 2 (10 ms, unknown); s1's at replica 1
    # (100 ms, known). At replica 3 s0 has two picks, which the score cannot tell apart.
    assert res["known_ages"] == pytest.approx([0.1])
    assert res["unknown_ages"] == pytest.approx([0.01])
