"""bench/bench_overload.py's run names: each numeric suffix read once, a repeated one refused
(the first `-sq<NN>` used to win silently, so `J-sq98` ran J's 0.95)."""

from __future__ import annotations

import pytest

from tests.bench_modules import bench_modules

J = "on@0.99-gate-refill300-pf-ends20-spike300-sq95-sj-rfs"


def test_numeric_suffixes_come_off_one_by_one():
    with bench_modules("bench_overload") as (bench,):
        name = J + "-fl80"
        got = {}
        for tag in ("refill", "fl", "spike", "sq", "ends", "q"):
            got[tag], name = bench.take_number(J, name, tag)
    assert got == {"refill": 300, "fl": 80, "spike": 300, "sq": 95, "ends": 20, "q": None}
    assert name == "on@0.99-gate-pf-sj-rfs"


def test_a_repeated_suffix_is_refused():
    with bench_modules("bench_overload") as (bench,), pytest.raises(SystemExit, match="-sq"):
        bench.take_number(J + "-sq98", J + "-sq98", "sq")
