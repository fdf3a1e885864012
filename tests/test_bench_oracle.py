"""bench/placement_oracle.py's oracles as bench_routing.py reports them: the unbounded
oracle and the best placement the servers' real cache sizes allow, on hand-made block keys
(no tokenizer, no servers)."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.sim.workload import Summary, WorkItem
from tests.bench_modules import bench_modules

BLOCK = 16


@pytest.fixture(scope="module")
def bench():
    with bench_modules("placement_oracle", "bench_routing") as modules:
        yield modules


def _rows(order: list[int], blocks: int = 4):
    """One request per entry of `order` (a tenant number), each tenant's prompt `blocks`
    blocks of its own keys and one token more (the engine recomputes the last token)."""
    return [
        (WorkItem(i, g, g, 0, 0, {}), [g * 1000 + b for b in range(blocks)], blocks * BLOCK + 1)
        for i, g in enumerate(order)
    ]


def test_bounded_is_the_unbounded_oracle_when_every_tenant_fits(bench) -> None:
    po, _ = bench
    rows = _rows([0, 1, 0, 1, 0, 1])
    o = po.oracles(rows, servers=2, blocks=4)
    # Each tenant's four blocks hit on its 2nd and 3rd request: 16 of 65 tokens x 4 x 4.
    assert o.unbounded == pytest.approx(16 * 4 * 4 / (65 * 6))
    assert o.bounded == pytest.approx(o.unbounded)


def test_bounded_falls_below_when_the_caches_cannot_hold_the_working_set(bench) -> None:
    po, _ = bench
    rows = _rows([0, 1, 0, 1, 0, 1])
    # One server of four blocks, two tenants alternating: each evicts the other, no hit.
    one = po.oracles(rows, servers=1, blocks=4)
    assert one.unbounded == pytest.approx(16 * 4 * 4 / (65 * 6))
    assert one.bounded == 0.0
    # Three tenants on two servers of four blocks: the best placement keeps two apart and
    # lets the third churn beside one of them, so it beats every spread but not the oracle.
    three = po.oracles(_rows([0, 1, 2] * 3), servers=2, blocks=4)
    assert 0.0 < three.bounded < three.unbounded
    assert three.bounded == max(po.bounded_placements(_rows([0, 1, 2] * 3), 2, 4).values())


def test_bench_routing_reports_hit_ratio_against_both_oracles(bench) -> None:
    po, br = bench
    s = Summary(requests=1, ok=1, hit_ratio=0.48, ttft_p50_s=0.1, ttft_p90_s=0.2,
                req_per_s=1.0, output_tok_per_s=1.0, duration_s=1.0)  # fmt: skip
    row = br.Row("tenants", "round-robin", 24.0, s)
    cells = br._routing_cells(row, po.Oracles(unbounded=0.8, bounded=0.6, best="partition"))
    assert cells[2:5] == ("48.0%", "60%", "80%")
    text = br.markdown([row], {("tenants", 24.0): po.Oracles(0.8, 0.6, "partition")}, "cmd", [],
                       1.0, 0, pressure=True, sessions=[8])  # fmt: skip
    assert "vs bounded" in text
    assert "24 80.0% (bounded 60.0%, partition)" in text


def test_mixed_sends_one_shot_groups_and_agent_sessions_joining_later(bench) -> None:
    _, br = bench
    oneshot, sessions, offsets = br.mixed_parts(16.0, 2, seed=1)
    items = br.ideal_items("mixed", 16.0, 2, 1)
    agent = [it for s in sessions for it in s]
    # Every request once, indexes unique; an agent session is a group of its own, after the
    # one-shot groups (the oracle's partition pins it alone).
    assert sorted(it.index for it in items) == list(range(len(oneshot) + len(agent)))
    assert {it.group for it in oneshot} == set(range(br.MIXED_GROUPS * 2))
    assert sorted({it.group for it in agent}) == [
        br.MIXED_GROUPS * 2 + k for k in range(br.MIXED_AGENTS.sessions)
    ]
    assert all(it.turn == 0 for it in oneshot)  # one-shot: never continued
    # In the oracle's order each session's turns keep theirs, and the first agent turn comes
    # after the one-shot requests sent before the agents join.
    pos = {it.index: n for n, it in enumerate(items)}
    for s in sessions:
        assert [pos[it.index] for it in s] == sorted(pos[it.index] for it in s)
    before = sum(at < br.MIXED_JOIN_S for at in offsets)
    assert min(pos[it.index] for it in agent) == before


def test_mixed_spaced_sends_the_same_agents_further_apart(bench) -> None:
    _, br = bench
    spaced = br.MIXED_WORKLOADS["mixed-spaced"]
    assert spaced == dataclasses.replace(br.MIXED_AGENTS, stagger_s=1.0)
    items = br.ideal_items("mixed-spaced", 16.0, 2, 1)
    assert [it.index for it in items] != [it.index for it in br.ideal_items("mixed", 16.0, 2, 1)]
    # The same requests, only the agents' start times differ.
    assert sorted(it.index for it in items) == sorted(
        it.index for it in br.ideal_items("mixed", 16.0, 2, 1)
    )


def test_interleaved_rounds_alternate_which_policy_runs_first(bench) -> None:
    _, br = bench
    assert br.round_orders(["a", "b", "c"], 3) == [
        ["a", "b", "c"],
        ["c", "b", "a"],
        ["a", "b", "c"],
    ]
    assert br.round_orders(["a"], 2) == [["a"], ["a"]]
