"""bench/trace_cut.py: the requests an `-ev` run cut, in `all_trace`'s form, from a row's
`cut_trace` or, for older rows, from the run's Envoy access log and timeline; with them a
slow request's other server is no longer free (bench/trace_slow.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.bench_modules import bench_modules
from tests.test_bench_trace_slow import CAP, hi
from tests.test_bench_trace_slow import row as entry

T0 = 1_800_000_000.0  # the run's start on Envoy's clock


def access(i: int, at: float, details: str, upstream: str, dur_s: float) -> str:
    stamp = time_text(T0 + at)
    code = 200 if details in ("via_upstream", "evicted") else 429
    return (f"{stamp} id={i} code={code} flags=- details={details} term=- upstream={upstream} "
            f"ufail=- dur={round(dur_s * 1000)} sent=100\n")  # fmt: skip


def time_text(t: float) -> str:
    import datetime

    d = datetime.datetime.fromtimestamp(t, datetime.UTC)
    return d.strftime("%Y-%m-%dT%H:%M:%S.") + f"{d.microsecond // 1000:03d}Z"


def old_row(tmp: Path) -> dict:
    """Served: a batch request on X (0.5 s wait) and on Y, the slow interactive one on X at
    10.0; cut: a batch request on Y, arrived 6.0, released in the sample (8.0, 8.5], cut 10.5
    (it held 10,900 tokens' room on Y then)."""
    trace = [
        [5.0, 0, "X", 10_900, 100, 10_900, 0.5, 0.505, 0.0, 30.0],  # sent after its wait
        entry(5.5, 0, "Y", 100, 100, 6.0),
        entry(10.0, 1, "X", 400, 400, 11.0, kv=0.5),
    ]
    log = tmp / "envoy-access-1.log"
    log.write_text(
        access(0, 5.0, "via_upstream", "X", 25.0)
        + access(1, 5.5, "via_upstream", "Y", 0.5)
        + access(2, 6.0, "evicted", "Y", 4.5)
        + access(3, 7.0, "rejected-saturated", "-", 0.001)
        + access(4, 10.0, "via_upstream", "X", 1.0)
    )
    # Samples every 0.5 s; released_lo: the served batch ones at 5.5 (5.0 + 0.5) and 5.5,
    # the cut one in (8.0, 8.5].
    t = [x / 2 for x in range(1, 41)]
    lo = {5.5: 2, 8.5: 1}
    tl = tmp / "timeline-0-x-ev.jsonl"
    tl.write_text("".join(json.dumps({"t": x, "released_lo": lo.get(x, 0)}) + "\n" for x in t))
    return {
        "run": "flow control x-ev",
        "all_trace": trace,
        "hi_trace": [{"tenant": "C", "est": 10_000}],
        "evicted": 1,
        "evicted_detail": [[6.0, "C", "batch", 2, 4.5]],
        "timeline": str(tl),
    }


def test_an_older_row_is_rebuilt_from_its_access_log_and_timeline(tmp_path: Path):
    with bench_modules("trace_cut") as (tc,):
        row = old_row(tmp_path)
        cut, how = tc.cut_trace(row)
        assert how.startswith("rebuilt from envoy-access-1.log")
        ((at, band, ep, est, mx, prompt, wait, to_srv, kv, done),) = cut
        assert (at, band, ep, est, kv, done) == (6.0, 0, "Y", 10_000, 0.0, 10.5)
        assert at + wait == 8.25  # the middle of its release interval
        assert to_srv == pytest.approx(wait + 0.005)  # the served batch requests' send time
        assert mx == 100 and prompt == 10_900  # nearest estimate's prompt; median max_tokens
        # A log that does not match the served requests is not used, and said so.
        row["all_trace"] = row["all_trace"][:2]
        assert tc.cut_trace(row) == ([], "no access log in the run's directory matches its "
                                     "served requests")  # fmt: skip


def test_a_saved_cut_trace_gets_its_unknowns_filled():
    with bench_modules("trace_cut") as (tc,):
        served = [[1.0, 0, "X", 500, 100, 480, 0.2, 0.205, 0.0, 3.0]]
        saved = [
            [2.0, 0, "Y", 500, 90, 0, 1.0, -1, -1, 4.0],
            [2.5, 0, "", 500, 90, 0, 0.0, -1, -1, 3.0],  # no server named: left out
        ]
        cut, how = tc.cut_trace({"all_trace": served, "cut_trace": saved})
        assert how == "saved; cut at the client's end, ~1 s late (timeline . gone)"
        assert cut == [[2.0, 0, "Y", 500, 90, 480, 1.0, pytest.approx(1.005), 0.0, 4.0]]


def test_a_saved_cut_ends_where_envoy_logged_it_not_where_the_client_saw_it(tmp_path: Path):
    # The client sees a cut stream end ~1 s after Envoy logged it (its delayed close): the
    # books and the engine's KV are rebuilt with the cut at Envoy's end when the log is there.
    with bench_modules("trace_cut") as (tc,):
        row = old_row(tmp_path)  # its access log: the cut request on Y, 6.0 to 10.5
        row["cut_trace"] = [[6.0, 0, "Y", 10_000, 100, 0, 2.25, -1, -1, 11.5]]
        cut, how = tc.cut_trace(row)
        assert how == "saved; cut at its end in envoy-access-1.log"
        assert [e[9] for e in cut] == [10.5]
        # A cut the log does not have keeps the client's end, and is said.
        row["cut_trace"].append([7.0, 0, "X", 10_000, 100, 0, 1.0, -1, -1, 12.0])
        cut, how = tc.cut_trace(row)
        assert [e[9] for e in cut] == [10.5, 12.0]
        assert how.endswith("; 1 not in it, cut at the client's end")


def test_the_cut_request_makes_the_other_server_full(tmp_path: Path):
    with bench_modules("trace_cut", "trace_slow") as (tc, slow):
        row = old_row(tmp_path)
        cut, _ = tc.cut_trace(row)
        t = hi(10.0, "X", kv=0.5)
        # Served requests only: Y was empty, the steer chose the fuller X.
        assert slow.classify(t, slow.rebuild(row["all_trace"]), CAP, None)[0] == "steer"
        # With the cut one, Y held 10,900 until 10.5: nowhere better.
        assert slow.classify(t, slow.rebuild(row["all_trace"] + cut), CAP, None)[0] == "unit"
