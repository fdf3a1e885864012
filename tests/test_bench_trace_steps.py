"""bench/trace_steps.py: the prefill steps it rebuilds from an overload run, on hand-built
requests at the overload bench's --sim-speed 0.5 (one step: 0.004 s + tokens / 5,000)."""

from __future__ import annotations

import pytest

from tests.bench_modules import bench_modules


def req(steps, rid: str, adm: float, prompt: int, done: float, *, band: int = 1,
        cut: bool = False):  # fmt: skip
    return steps.Req(rid, "X", band, adm, adm, adm, prompt, done, cut)


def test_a_prompt_cut_in_its_step_keeps_the_lane_and_the_next_prompts_spill():
    with bench_modules("trace_steps") as (ts,):
        batch = req(ts, "bC", 0.0, 2000, 0.1, band=0, cut=True)  # cut 0.1 s into its step
        first = req(ts, "IA", 0.05, 300, 9.0)
        second = req(ts, "IC", 0.06, 2000, 9.0)
        steps = ts.replay([batch, first, second], 0.5)
    # The cut prompt's step runs its full length (0.404 s) and gives it no first token.
    assert steps[0].start == 0.0
    assert steps[0].end == pytest.approx(0.404)
    assert batch.first is None
    # The two interactive prompts start together; the second spills into another step.
    assert first.start == second.start == steps[1].start
    assert [n for _, n in steps[1].chunks] == [300, 1748]
    assert first.first == steps[1].end
    assert second.first == steps[2].end
    assert [n for _, n in steps[2].chunks] == [252]


def test_a_prompt_cut_before_its_step_never_runs_and_decoders_take_budget():
    with bench_modules("trace_steps") as (ts,):
        decoding = req(ts, "bA", 0.0, 100, 5.0, band=0)
        gone = req(ts, "bB", 0.01, 1000, 0.02, band=0, cut=True)  # waits, cut, never starts
        late = req(ts, "IC", 0.03, 2100, 9.0)
        steps = ts.replay([decoding, gone, late], 0.5)
    assert [[q.id for q, _ in s.chunks] for s in steps] == [["bA"], ["IC"], ["IC"]]
    assert gone.start is None
    # bA decodes from the end of its step: the budget is 2048 less one.
    assert [n for _, n in steps[1].chunks] == [2047]
    assert [n for _, n in steps[2].chunks] == [53]
