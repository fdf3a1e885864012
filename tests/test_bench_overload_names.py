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


def test_hi_pause_drops_only_interactive_arrivals_in_it():
    with bench_modules("bench_overload") as (bench,):
        per = {"A": 400.0, "B": 1000.0, "C": 2000.0}
        full = bench.burst(20000, 1500, per, 30.0, 3, spread=64)
        paused = bench.burst(20000, 1500, per, 30.0, 3, spread=64, hi_pause=(10.0, 20.0))
        assert bench.parse_pause("20:35") == (20.0, 35.0)
        assert bench.parse_pause("") is None
        for bad in ("20", "35:20", "a:b"):
            with pytest.raises(SystemExit, match="--hi-pause"):
                bench.parse_pause(bad)

    def key(r):
        return (r.at, r.tenant, r.objective, r.max_tokens)

    kept = [r for r in full if not (r.objective == "interactive" and 10.0 <= r.at < 20.0)]
    assert [key(r) for r in paused] == [key(r) for r in kept]
    assert len(kept) < len(full)  # some interactive arrivals were in the pause


def test_ev_runs_cut_batch_per_server():
    from extproc.flowcontrol.config import FlowControlSettings, build_flow_config
    from extproc.flowcontrol.eviction import LowerBandEvictionFilter

    with bench_modules("bench_overload") as (bench,):
        cfg = bench.picker_config(bench.Path("o.yaml"), flow=True, evict=True)
        plain = bench.picker_config(bench.Path("o.yaml"), flow=True)
    sched = cfg["scheduling"]
    flow = build_flow_config(sched["flowControl"], None, sched["plugins"])
    assert flow.eviction is not None
    assert isinstance(flow.eviction.filter, LowerBandEvictionFilter)
    import msgspec

    settings = msgspec.convert(cfg["flow_control"], FlowControlSettings)
    assert settings.evict_per_endpoint
    assert "enableEviction" not in plain["scheduling"]["flowControl"]
    assert "evict_per_endpoint" not in plain["flow_control"]


def test_tr_runs_send_the_trailers_without_eviction():
    # `-tr`: the control for `-ev`, whose Envoy sends the response trailers for the cut.
    with bench_modules("bench_overload") as (bench,):
        assert bench.take_cut(J, J + "-gh-tr") == (False, True, J + "-gh")
        assert bench.take_cut(J, J + "-gh-ev") == (True, True, J + "-gh")
        assert bench.take_cut(J, J + "-gh") == (False, False, J + "-gh")
        with pytest.raises(SystemExit, match="-tr with -ev"):
            bench.take_cut(J, J + "-ev-tr")
