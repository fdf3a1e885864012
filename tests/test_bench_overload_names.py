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


def test_gate_head_comes_off_before_the_gate_tokens():
    with bench_modules("bench_overload") as (bench,):
        # (J's other suffixes already taken off, as the bench does before the gate)
        assert bench.take_gate(J, "on@0.99-gate-gh", 4096) == (4096, True, "on@0.99")
        assert bench.take_gate(J, "on@0.99-gate1500-gh", 4096) == (1500, True, "on@0.99")
        assert bench.take_gate(J, "on-gate-gh@0.99", 0) == (0, True, "on@0.99")
        assert bench.take_gate(J, "on@0.99-gate", 2048) == (2048, False, "on@0.99")
        assert bench.take_gate(J, "on@0.99", 2048) == (0, False, "on@0.99")
        with pytest.raises(SystemExit, match="-gh"):
            bench.take_gate(J, "on@0.99-gh", 2048)
        cfg = bench.picker_config(
            bench.Path("o.yaml"), flow=True, gate_tokens=2048, gate_at_start=True
        )
    gate = [p for p in cfg["scheduling"]["plugins"] if p["type"] == "prefill-gate"]
    assert gate[0]["parameters"]["activeAtStart"] is True
