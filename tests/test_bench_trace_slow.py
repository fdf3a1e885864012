"""bench/trace_slow.py: the classes bench/RESULTS.md counts the slow interactive requests of
the overload bench by (issue 15, twenty-eighth session), on a hand-built run of two servers
of 11,200 tokens (the ratio 1.0: 700 blocks of 16, 699 usable)."""

from __future__ import annotations

import json
from pathlib import Path

from tests.bench_modules import bench_modules

CAP = 700 * 16.0


def row(at: float, band: int, ep: str, est: int, prompt: int, done: float, *, mx: int = 100,
        wait: float = 0.0, kv: float = 0.0) -> list:  # fmt: skip
    """An `all_trace` entry: [at, band, server, estimate, max_tokens, engine prompt tokens,
    picker wait, to the engine, KV wait, done]."""
    return [at, band, ep, est, mx, prompt, wait, 0.005, kv, done]


def hi(at: float, ep: str, *, wait: float = 0.0, kv: float = 0.0) -> dict:
    return {"at": at, "endpoint": ep, "wait": wait, "engine": [kv, 0.0, 0.07], "ttft": 2.0}


def classify(trace: list[list], t: dict, timeline: list[dict] | None = None,
             tmp: Path | None = None) -> str:  # fmt: skip
    with bench_modules("trace_slow") as (slow,):
        tl = None
        if timeline is not None:
            assert tmp is not None
            path = tmp / "timeline.jsonl"
            path.write_text("".join(json.dumps(x) + "\n" for x in timeline))
            tl = slow.Timeline(path)
        return slow.classify(t, slow.rebuild(trace), CAP, tl)[0]


def test_kv_waits_without_a_picker_wait_are_steer_or_unit():
    full_x = row(5.0, 0, "X", 10_900, 10_900, 30.0)  # X's engine: 688 of 699 blocks held
    me = row(10.0, 1, "X", 400, 400, 11.0, kv=0.5)  # 32 blocks: X lacks 21
    gone = row(0.1, 0, "Y", 100, 100, 1.0)  # Y served one request long before: empty now
    # Y empty: room there in the books and the engine, the steer chose the fuller server.
    assert classify([full_x, gone, me], hi(10.0, "X", kv=0.5)) == "steer"
    # Y full too: nowhere better; the engine held more than the books counted.
    full_y = row(5.0, 0, "Y", 10_900, 10_900, 30.0)
    assert classify([full_x, full_y, me], hi(10.0, "X", kv=0.5)) == "unit"


def test_room_waits_by_clump_reserve_and_credit(tmp_path: Path):
    # Both servers 9,000 booked: 2,200 free, the C needs 2,600 (2,500 + 100).
    base = [row(5.0, 0, ep, 8_900, 8_900, 30.0) for ep in ("X", "Y")]
    me = row(20.0, 1, "X", 2_500, 2_500, 22.0, wait=0.5)
    t = hi(20.0, "X", wait=0.5)
    a = row(19.9, 1, "Y", 400, 400, 25.0)  # an A 0.1 s before: in the clump (500)

    def tl(reserve: int, credit: int) -> list[dict]:
        return [{"t": 19.5, "reserved_each": [reserve], "refill_each": [credit]},
                {"t": 20.0, "reserved_each": [reserve], "refill_each": [credit]}]  # fmt: skip

    assert classify([*base, a, me], t, tl(3_000, 0), tmp_path) == "over"  # 3,100 > 3,000
    assert classify([*base, me], t, tl(3_000, 1_000), tmp_path) == "lent"  # 2,000 kept
    assert classify([*base, me], t, tl(3_000, 0), tmp_path) == "held"
    assert classify([*base, me], t) == "room"  # no timeline: not split
    # Released before the engine had room: a KV wait after the picker's.
    t_kv = hi(20.0, "X", wait=0.5, kv=0.3)
    assert classify([*base, a, me], t_kv, tl(3_000, 0), tmp_path) == "over+kv"


def test_a_picker_wait_with_room_is_head_of_line_and_the_start_early():
    small = row(20.0, 1, "X", 400, 400, 21.0, wait=0.5)
    assert classify([small], hi(20.0, "X", wait=0.5)) == "hol"
    assert classify([small], hi(0.6, "X")) == "early"
    assert classify([row(20.0, 1, "X", 400, 400, 21.0)], hi(20.0, "X")) == "lane"
