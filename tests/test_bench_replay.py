"""bench/replay_decisions.py: the plan (which request goes where, in what order) and the
replay's timing (open loop: never before the recorded send time; closed loop: a session's
turns one after another), checked with a fake sender so no server is needed."""

from __future__ import annotations

import asyncio
import itertools
import sys
import time

import pytest

from extproc.sim.workload import WorkItem
from tests.bench_modules import bench_modules


@pytest.fixture(scope="module")
def rd():
    with bench_modules("replay_decisions") as (module,):
        yield module


def _item(index: int, conversation: int = 0, turn: int = 0) -> WorkItem:
    return WorkItem(index, 0, conversation, turn, 0, {"n": index})


def _row(index: int, served_by: str, sent_s: float, status: int = 200) -> dict:
    return {"index": index, "served_by": served_by, "sent_s": sent_s, "status": status}


def test_servers_map_in_sorted_name_order_and_a_bigger_trace_is_refused(rd):
    rows = [_row(0, "b:2", 0.0), _row(1, "a:1", 0.1), _row(2, "b:2", 0.2), _row(3, "", 0.3)]
    assert rd.endpoint_map(rows, 4) == {"a:1": 0, "b:2": 1}
    with pytest.raises(ValueError, match="2 servers"):
        rd.endpoint_map(rows, 1)


def test_open_loop_plan_keeps_recorded_send_times_and_drops_failed_requests(rd):
    items = [_item(i) for i in range(5)]
    # Recorded order differs from the items' order (an event loop sends late sometimes).
    rows = [
        _row(0, "s1", 0.30), _row(1, "s0", 0.10), _row(2, "s1", 0.20),
        _row(3, "s0", 0.40, status=0), _row(4, "", 0.5, status=0),
    ]  # fmt: skip
    plan = rd.open_loop_plan(rows, items, 2)
    assert [(s.item.index, s.target, s.at_s) for s in plan] == [
        (1, 0, 0.10), (2, 1, 0.20), (0, 1, 0.30),
    ]  # fmt: skip


def test_closed_loop_plan_keeps_each_sessions_turn_order(rd):
    sessions = [[_item(0, 0, 0), _item(2, 0, 1), _item(4, 0, 2)], [_item(1, 1, 0), _item(3, 1, 1)]]
    rows = [_row(4, "x", 0.9), _row(0, "x", 0.0), _row(1, "y", 0.1), _row(3, "x", 0.5),
            _row(2, "y", 0.4, status=502)]  # fmt: skip
    plan = rd.closed_loop_plan(rows, sessions, 4)
    assert [[(s.item.index, s.target) for s in ss] for ss in plan] == [
        [(0, 0), (4, 0)], [(1, 1), (3, 0)],
    ]  # fmt: skip


def test_open_loop_replay_sends_each_request_at_its_time_to_its_server(rd):
    plan = [rd.Send(_item(i), i % 2, at_s=0.05 * i) for i in range(6)]
    seen: list[tuple[int, str, float]] = []
    running = [0, 0]  # now, most at once

    async def send(url: str, item: WorkItem, t0: float) -> dict:
        seen.append((item.index, url, time.perf_counter() - t0))
        running[0] += 1
        running[1] = max(running)
        await asyncio.sleep(0.2)  # slower than the gaps: requests overlap, as in open loop
        running[0] -= 1
        return {"index": item.index}

    rows = asyncio.run(rd.replay_open(plan, ["u0", "u1"], send))
    assert sorted(r["index"] for r in rows) == list(range(6))
    assert [i for i, _, _ in seen] == list(range(6))  # timers fire in deadline order
    for i, url, at in seen:
        assert url == f"u{i % 2}"
        assert at >= 0.05 * i - 0.001  # never early (late is the machine's doing)
    # Open loop: a request goes out while earlier ones run (timers fire in deadline order, so
    # the second, due at 0.05 s, always starts before the first's 0.2 s sleep ends).
    assert running[1] >= 2


def test_closed_loop_replay_sends_a_turn_after_the_previous_one_ended(rd):
    plan = [[rd.Send(_item(2 * t + k, k, t), k) for t in range(3)] for k in range(2)]
    spans: dict[int, list[tuple[float, float]]] = {0: [], 1: []}

    async def send(url: str, item: WorkItem, t0: float) -> dict:
        start = time.perf_counter() - t0
        await asyncio.sleep(0.03)
        spans[item.conversation].append((start, time.perf_counter() - t0))
        return {"index": item.index, "url": url}

    rows = asyncio.run(rd.replay_closed(plan, ["u0", "u1"], send, stagger_s=0.1, think_s=0.02))
    assert [r["index"] for r in rows] == [0, 2, 4, 1, 3, 5]
    assert {r["url"] for r in rows[:3]} == {"u0"} and {r["url"] for r in rows[3:]} == {"u1"}
    assert spans[1][0][0] >= 0.1 - 0.001  # the second session starts one stagger later
    for ss in spans.values():
        for (_, end), (start, _) in itertools.pairwise(ss):
            assert start >= end + 0.02 - 0.001  # the previous turn ended, then think time


def test_causes_sum_uncached_tokens_and_count_the_slow_tail(rd):
    rows = [
        {"index": i, "status": 200, "ttft_s": 0.1 * (i + 1), "prompt_tokens": 100,
         "cached_tokens": 100 if i % 2 else 0}
        for i in range(10)
    ]  # fmt: skip
    rows.append({"index": 10, "status": 0})  # failed: neither work nor tail
    cause = {i: "hit" if i % 2 else "spill: index holder lost on score" for i in range(11)}
    work, slow = rd.by_cause(rows, cause)
    assert work == {"spill: index holder lost on score": 500, "hit": 0}
    # p90 of ten TTFTs 0.1..1.0 is the tenth (index 9, a hit): only it is at or above.
    assert slow == {"spill: index holder lost on score": 0, "hit": 1}


def test_lane_delta_and_line_read_the_starved_lanes(rd):
    tr = sys.modules["trace_routing"]
    before = {"a": {"steps": 1, "tokens": 100, "scheduled_s": 0.1, "wall_s": 0.1}}
    after = {
        "a": {"steps": 5, "tokens": 10_100, "scheduled_s": 1.1, "wall_s": 2.1},
        "b": {"steps": 2, "tokens": 5_000, "scheduled_s": 0.5, "wall_s": 0.5},
    }
    d = tr.lane_delta(before, after)
    assert d["a"] == {"steps": 4, "tokens": 10_000, "scheduled_s": 1.0, "wall_s": 2.0}
    assert d["all"] == {"steps": 6, "tokens": 15_000, "scheduled_s": 1.5, "wall_s": 2.5}
    line = tr.lane_line(d)
    assert "wall / scheduled 1.67" in line and "per server 2.00 1.00" in line
