"""The simulators' prefill lanes against their schedule: how starved a run was.

The simulator's histograms charge each step its scheduled end (so a picker learns the
nominal speed), while on a busy machine its wake-ups come late and the lane really runs
slower (`GET /sim/steps`: steps, tokens, scheduled and wall seconds). A run whose lanes
ran well above 1.0x their schedule measured the machine as much as the policy.
"""

from __future__ import annotations

import httpx


def lane_clock(urls: list[str]) -> dict[str, dict[str, float]]:
    """Each simulated server's prefill lane clock so far (`/sim/steps`: steps, tokens,
    scheduled and wall seconds), by URL."""
    return {u: httpx.get(f"{u}/sim/steps", timeout=10).json() for u in urls}


def lane_delta(
    before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
) -> dict[str, dict[str, float]]:
    """What each server's lane did between two `lane_clock` readings, plus the fleet's sum
    under "all"."""
    out = {
        u: {k: round(v - before.get(u, {}).get(k, 0), 4) for k, v in a.items()}
        for u, a in after.items()
    }
    out["all"] = {k: round(sum(d[k] for d in out.values()), 4) for k in next(iter(after.values()))}
    return out


def lane_ratio(delta: dict[str, dict[str, float]]) -> float:
    """The fleet's lanes: wall seconds over scheduled seconds (nan if nothing ran)."""
    d = delta["all"]
    return d["wall_s"] / d["scheduled_s"] if d["scheduled_s"] > 0 else float("nan")


def lane_line(delta: dict[str, dict[str, float]]) -> str:
    """The simulators' lanes: how much slower than scheduled they ran (the machine), overall
    and per server (1.00: on time; the picker learns the scheduled speed)."""
    d = delta["all"]
    per = " ".join(
        f"{v['wall_s'] / v['scheduled_s']:.2f}" for u, v in sorted(delta.items())
        if u != "all" and v["scheduled_s"] > 0
    )  # fmt: skip
    return (
        f"sim lanes: wall / scheduled {lane_ratio(delta):.2f} ({d['tokens']:.0f} tokens, "
        f"scheduled {d['scheduled_s']:.2f} s, wall {d['wall_s']:.2f} s; per server {per})"
    )
