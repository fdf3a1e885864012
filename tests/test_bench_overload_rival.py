"""bench/overload_rival.py: the two-replica figures bench/RESULTS.md quotes (whose batch came
before a slow interactive request, who released the band's later requests ahead of a
waiting one, and how long after an end a waiting request was released)."""

from __future__ import annotations

from tests.bench_modules import bench_modules

A, B = 101, 202  # the two pickers' pids


def served(at: float, band: int, ep: str, tokens: int, wait: float, done: float) -> list:
    """One `all_trace` row: arrival, band, server, estimate, max_tokens, engine prompt,
    picker wait, send to engine arrival, KV wait, done."""
    return [at, band, ep, tokens - 100, 100, tokens, wait, wait + 0.01, 0.0, done]


def test_a_waiting_request_is_told_who_took_its_room_and_who_freed_it():
    rows = [
        (served(0.0, 0, "s0", 1000, 0.0, 0.9), B),  # the other's batch ends: frees s0
        (served(0.7, 0, "s0", 500, 0.0, 5.0), B),  # the other's batch, before the request
        (served(1.0, 1, "s0", 2600, 0.5, 3.0), A),  # waits 0.5 s, released at 1.5
        (served(1.1, 1, "s1", 400, 0.05, 2.0), B),  # the band's later one, released ahead
        (served(1.2, 1, "s0", 300, 0.0, 1.4), A),  # own later one; ends at 1.4 on s0
        (served(1.25, 0, "s1", 700, 0.0, 6.0), B),  # the other's batch while it waits
    ]
    row = {
        "run": "flow control on-2-replicas",
        "picker_pids": [A, B],
        "all_trace": [r for r, _ in rows],
        "all_picker": [p for _, p in rows],
        "hi_trace": [
            {"at": 1.0, "tenant": "C", "picker": A, "endpoint": "s0", "ttft": 1.0, "wait": 0.5},
            {"at": 1.1, "tenant": "A", "picker": B, "endpoint": "s1", "ttft": 0.3, "wait": 0.05},
            {"at": 1.2, "tenant": "A", "picker": A, "endpoint": "s0", "ttft": 0.2, "wait": 0.0},
        ],
        "timeline": "",  # none kept: reserve and credit read None
    }
    with bench_modules("overload_rival") as (rival,):
        out = rival.rival(row, unloaded_p99=0.4, over=2.0, before=0.5)
    assert out is not None
    [slow] = out["slow"]
    assert (slow["at"], slow["picker"], slow["server"], slow["wait"]) == (1.0, "A", 0, 0.5)
    # Batch released from 0.5 s before it to its release: the other's 500 on s0 and 700 on
    # s1; the request's own picker released none.
    assert slow["batch"] == {"B": {0: 500, 1: 700}}
    assert out["own_other_slow"] == [0, 1200]
    # The band's later requests released while it waited: one by its own picker (on its
    # server, 300 tokens), one by the other (on the other server: no tokens on its own).
    assert out["jumped"] == {"own": [1, 300], "other": [1, 0]}
    # Released 0.1 s after the last end on its server, its own picker's request.
    assert out["end_lags"] == {"own": [0.1], "other": []}


def test_a_run_without_the_pickers_recorded_is_skipped():
    with bench_modules("overload_rival") as (rival,):
        assert rival.rival({"run": "x", "all_trace": []}, 0.4, 2.0, 0.5) is None
