"""The last llm-d flow-control policies: `soft-reflective-ceiling-policy` (graduated,
throttling per-band ceilings) and `program-aware-fairness` (least attained service), on
their own and inside the controller with a manual clock; plus GIE v1.2-v1.4's inline
`saturationDetector` thresholds."""

from __future__ import annotations

import asyncio

import pytest

from extproc.errors import ConfigError
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.detectors import UtilizationDetector
from extproc.flowcontrol.policies import Arrival, SoftReflectiveCeiling
from extproc.flowcontrol.programs import ProgramAwareFairness
from tests.flowcontrol.test_controller import finish, make, place, req, settle, start

# -- soft-reflective-ceiling-policy --------------------------------------------------------


def opens(policy: SoftReflectiveCeiling, priority: int, prios, sat: float, calls: int) -> int:
    """How many of `calls` dispatch opportunities the band is open at this saturation."""
    return sum(sat < policy.ceiling(priority, prios, sat) for _ in range(calls))


def test_soft_ceiling_never_gates_the_top_band_or_a_single_band():
    pol = SoftReflectiveCeiling()
    for sat in (0.0, 0.5, 0.9, 0.99):
        assert pol.ceiling(10, (10, 5, 0), sat) == 1.0
        assert pol.ceiling(0, (0,), sat) == 1.0


def test_soft_ceiling_opens_lower_bands_fully_below_their_reflective_ceiling():
    pol = SoftReflectiveCeiling()
    prios = (10, 5, 0)
    # 0.3: rank 1's ceiling 1 - 0.3/2 = 0.85, rank 2's 0.7: both above saturation.
    assert opens(pol, 5, prios, 0.3, 10) == 10
    assert opens(pol, 0, prios, 0.3, 10) == 10
    # 0.7: rank 1 (ceiling 0.65) throttled; rank 2 (0.3) too: period round(2.33) = 2.
    # 0.55: rank 1 (ceiling 0.725) open; rank 2 (0.45) throttled, period round(1.22) = 1.
    assert opens(pol, 5, prios, 0.55, 10) == 10
    assert opens(pol, 0, prios, 0.55, 10) == 10
    assert opens(pol, 5, prios, 0.7, 10) == 5
    assert opens(pol, 0, prios, 0.7, 10) == 5


@pytest.mark.parametrize(
    ("sat", "period"), [(0.5, 1), (2 / 3, 2), (0.75, 3), (0.8, 4), (0.9, 9), (0.95, 19)]
)
def test_soft_ceiling_throttled_band_is_open_one_opportunity_per_period(sat, period):
    pol = SoftReflectiveCeiling()
    assert opens(pol, 0, (1, 0), sat, period * 6) == 6


def test_soft_ceiling_shuts_lower_bands_at_full_saturation():
    pol = SoftReflectiveCeiling()
    assert pol.ceiling(0, (1, 0), 1.0) == 0.0
    assert pol.ceiling(0, (1, 0), 1.7) == 0.0
    assert pol.ceiling(1, (1, 0), 1.0) == 1.0  # the controller itself gates at >= 1.0


def test_soft_ceiling_throttled_bands_share_one_phase():
    """Every throttled band is open on the same opportunities: a lower band is never
    starved by being out of phase with a higher throttled one."""
    pol = SoftReflectiveCeiling()
    prios = (10, 5, 0)
    # 0.8: rank 1 (ceiling 0.6) and rank 2 (0.2) both throttled, period 4.
    pattern = [pol.ceiling(5 if i % 2 else 0, prios, 0.8) for i in range(16)]
    assert pattern.count(1.0) == 4
    # The tick is shared: the open opportunities are every 4th call, whichever band asks.
    assert [i for i, c in enumerate(pattern) if c == 1.0] == [3, 7, 11, 15]


def test_soft_ceiling_takes_no_parameters():
    plugins = [{"type": "soft-reflective-ceiling-policy", "parameters": {"threshold": 0.5}}]
    with pytest.raises(ConfigError, match="threshold"):
        build_flow_config({"usageLimitPolicyPluginRef": "soft-reflective-ceiling-policy"}, None,
                          plugins)  # fmt: skip
    cfg = build_flow_config(
        {"usageLimitPolicyPluginRef": "soft-reflective-ceiling-policy"},
        None,
        [{"type": "soft-reflective-ceiling-policy"}],
    )
    assert isinstance(cfg.usage_limit, SoftReflectiveCeiling)


async def drain_low_band(sat_used: int, policy: str, rounds: int = 40) -> int:
    """Capacity 10 with `sat_used` slots busy elsewhere; the low band of two has 60 queued
    requests. Each round: one dispatch opportunity (a tick), then whatever started ends.
    Returns how many started."""
    plugins = [{"type": policy}] if policy != "static-usage-limit-policy" else []
    ctl, slots, _ = make(
        capacity=10,
        plugins=plugins,
        flow_control={
            "usageLimitPolicyPluginRef": policy,
            "priorityBands": [{"priority": 1}, {"priority": 0}],
        },
    )
    slots.used = 10  # full while queueing
    tasks = await start(ctl, *[req(priority=0) for _ in range(60)])
    slots.used = sat_used
    started = 0
    for _ in range(rounds):
        ctl.tick()
        await settle()
        for t in tasks:
            if t.done() and not getattr(t, "seen", False):
                t.seen = True  # type: ignore[attr-defined]
                started += 1
                finish(ctl, slots, place(ctl, slots, t))
        tasks = [t for t in tasks if not t.done()]
    ctl.close()
    await asyncio.gather(*tasks, return_exceptions=True)
    return started


async def test_soft_ceiling_throttles_the_low_band_with_saturation_in_the_controller():
    # The static ceiling (1.0) drains the whole queue at 0.8; so does the soft ceiling at
    # 0.3, below the low band's reflective ceiling (0.7).
    assert await drain_low_band(8, "static-usage-limit-policy") == 60
    assert await drain_low_band(3, "soft-reflective-ceiling-policy") == 60
    # Past it the band is throttled, more the higher the saturation, but never shut.
    at_08 = await drain_low_band(8, "soft-reflective-ceiling-policy")
    at_09 = await drain_low_band(9, "soft-reflective-ceiling-policy")
    assert 0 < at_09 < at_08 < 30


# -- program-aware-fairness ----------------------------------------------------------------


def arrival(seq: int, enqueued: float) -> Arrival:
    return Arrival(seq=seq, enqueued=enqueued, ttl_s=0.0)


def test_las_serves_the_program_with_least_attained_service():
    pol = ProgramAwareFairness()
    pol.charge("heavy", 1000, 0, now=0.0)
    pol.charge("light", 10, 0, now=0.0)
    # heavy's head has waited longer, but service weighs 0.8 against the wait's 0.2.
    heads = {"heavy": arrival(1, 0.0), "light": arrival(2, 5.0)}
    assert pol.pick_at(heads, now=6.0) == "light"


def test_las_head_wait_breaks_ties_between_equal_programs():
    pol = ProgramAwareFairness()
    heads = {"a": arrival(2, 3.0), "b": arrival(1, 1.0)}  # b's head is older
    assert pol.pick_at(heads, now=4.0) == "b"
    # Head wait alone can win when it is weighed more than service.
    tilted = ProgramAwareFairness(
        ProgramAwareFairness.Params(lasWeightService=0.1, lasWeightHeadWait=0.9)
    )
    tilted.charge("b", 1000, 0, now=0.0)
    assert tilted.pick_at(heads, now=4.0) == "b"


def test_las_output_tokens_weigh_twice_input_tokens():
    pol = ProgramAwareFairness(ProgramAwareFairness.Params(lasHalfLifeSeconds=0))
    pol.charge("p", 100, 50, now=0.0)
    assert pol.service("p", 0.0) == pytest.approx(200.0)


def test_las_service_decays_with_its_half_life_even_while_idle():
    pol = ProgramAwareFairness(ProgramAwareFairness.Params(lasHalfLifeSeconds=60))
    pol.charge("p", 1000, 0, now=0.0)
    assert pol.service("p", 60.0) == pytest.approx(500.0)
    assert pol.service("p", 120.0) == pytest.approx(250.0)
    pol.charge("p", 100, 0, now=120.0)  # decay folded in before adding
    assert pol.service("p", 120.0) == pytest.approx(350.0)
    kept = ProgramAwareFairness(ProgramAwareFairness.Params(lasHalfLifeSeconds=0))
    kept.charge("p", 1000, 0, now=0.0)
    assert kept.service("p", 1e6) == pytest.approx(1000.0)


def test_las_refund_takes_a_cut_requests_charge_back_as_decayed_since_its_dispatch():
    pol = ProgramAwareFairness(ProgramAwareFairness.Params(lasHalfLifeSeconds=60))
    pol.charge("p", 1000, 0, now=0.0)  # the request to be cut
    pol.charge("p", 200, 100, now=60.0)  # 400, kept
    assert pol.service("p", 60.0) == pytest.approx(900.0)
    # Cut at 120 s: its 1000 weigh 250 by now, the kept 400 weigh 200.
    pol.refund("p", 1000, 0, charged_at=0.0, now=120.0)
    assert pol.service("p", 120.0) == pytest.approx(200.0)
    # The program's whole service refunded: none left (not a float residue), nothing below.
    pol.refund("p", 200, 100, charged_at=60.0, now=180.0)
    assert pol.service("p", 180.0) == 0.0
    pol.refund("p", 5000, 0, charged_at=170.0, now=180.0)
    assert pol.service("p", 180.0) == 0.0
    # A program never charged, or forgotten since, has nothing to give back.
    pol.refund("q", 10, 0, charged_at=0.0, now=180.0)
    assert pol.programs() == 1
    kept = ProgramAwareFairness(ProgramAwareFairness.Params(lasHalfLifeSeconds=0))
    kept.charge("p", 1000, 0, now=0.0)
    kept.charge("p", 300, 0, now=10.0)
    kept.refund("p", 1000, 0, charged_at=0.0, now=1e6)  # no decay: all of it
    assert kept.service("p", 1e6) == pytest.approx(300.0)


def test_las_services_reads_the_decayed_service_without_folding_it_in():
    pol = ProgramAwareFairness(ProgramAwareFairness.Params(lasHalfLifeSeconds=60))
    pol.charge("a", 1000, 0, now=0.0)
    pol.charge("b", 0, 100, now=60.0)
    assert pol.services(60.0) == pytest.approx({"a": 500.0, "b": 200.0})
    assert pol.services(120.0) == pytest.approx({"a": 250.0, "b": 100.0})
    assert pol.services(60.0) == pytest.approx({"a": 500.0, "b": 200.0})  # unchanged by reads


def test_las_forgets_idle_programs_on_the_sweep():
    pol = ProgramAwareFairness(
        ProgramAwareFairness.Params(evictionTtlSeconds=10, evictionSweepSeconds=5)
    )
    pol.charge("old", 1000, 0, now=0.0)
    pol.pick_at({"new": arrival(1, 0.0)}, now=0.0)
    pol.pick_at({"new": arrival(1, 0.0)}, now=4.0)
    assert pol.programs() == 2  # no sweep before 5s
    pol.charge("new", 1, 0, now=11.0)
    pol.pick_at({"new": arrival(2, 11.0)}, now=11.0)
    assert pol.programs() == 1  # "old": nothing for more than 10s
    assert pol.service("old", 11.0) == 0.0


def test_program_service_counts_across_the_bands_that_share_the_policy():
    cfg = build_flow_config(
        {"defaultPriorityBand": {"fairnessPolicyRef": "program-aware-fairness"}},
        None,
        [{"type": "program-aware-fairness"}],
    )
    high, low = cfg.band(5)[2], cfg.band(0)[2]
    assert high is low  # one plugin instance, as in llm-d
    assert cfg.band(0)[1] is not cfg.band(5)[1]  # ordering policies stay per band
    # Two differently configured plugins stay apart.
    cfg = build_flow_config(
        {"priorityBands": [{"priority": 1, "fairnessPolicyRef": "a"},
                           {"priority": 0, "fairnessPolicyRef": "b"}]},
        None,
        [{"type": "program-aware-fairness", "name": "a"},
         {"type": "program-aware-fairness", "name": "b",
          "parameters": {"lasHalfLifeSeconds": 0}}],
    )  # fmt: skip
    assert cfg.band(1)[2] is not cfg.band(0)[2]


@pytest.mark.parametrize(
    "params",
    [
        {"strategy": "wfq"},
        {"evictionSweepSeconds": 0},
        {"lasWeightService": -1},
        {"lasHalfLifeSeconds": -5},
        {"evictionTtlSeconds": -1},
        {"bogus": 1},
    ],
)
def test_program_aware_parameters_are_checked(params):
    plugins = [{"type": "program-aware-fairness", "parameters": params}]
    with pytest.raises(ConfigError):
        build_flow_config(
            {"defaultPriorityBand": {"fairnessPolicyRef": "program-aware-fairness"}}, None, plugins
        )


async def test_program_aware_in_the_controller_lets_a_light_program_overtake():
    ctl, slots, clock = make(
        capacity=1,
        plugins=[{"type": "program-aware-fairness"}],
        flow_control={"defaultPriorityBand": {"fairnessPolicyRef": "program-aware-fairness"}},
    )
    (first,) = await start(ctl, req("heavy", tokens=5000))  # admitted at once, charged
    t0 = place(ctl, slots, first)
    heavy = await start(ctl, req("heavy", tokens=5000), req("heavy", tokens=5000))
    clock.t += 1.0
    light = await start(ctl, req("light", tokens=10))
    finish(ctl, slots, t0)
    await settle()
    # heavy's queued head is older, but light has attained far less service.
    assert light[0].done() and not any(t.done() for t in heavy)
    finish(ctl, slots, place(ctl, slots, light[0]))
    await settle()
    assert heavy[0].done()  # then heavy, in its own order
    ctl.close()
    await settle()


# -- saturationDetector, GIE v1.2-v1.4 -----------------------------------------------------


def test_inline_saturation_detector_thresholds_configure_the_utilization_detector():
    sd = {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.75,
          "metricsStalenessThreshold": "150ms"}  # fmt: skip
    cfg = build_flow_config(None, sd, [])
    det = cfg.detector
    assert isinstance(det, UtilizationDetector)
    assert det.params.queueDepthThreshold == 8
    assert det.params.kvCacheUtilThreshold == 0.75
    assert det.stale_after_s == pytest.approx(0.15)
    # Partial: the rest take the detector's defaults.
    assert build_flow_config(None, {"kvCacheUtilThreshold": 0.5}, []).detector.params == (
        UtilizationDetector.Params(kvCacheUtilThreshold=0.5)
    )


@pytest.mark.parametrize(
    "sd",
    [
        {"queueDepthThreshold": 0},
        {"kvCacheUtilThreshold": 1.5},
        {"metricsStalenessThreshold": "soon"},
        {"pluginRef": "utilization-detector", "queueDepthThreshold": 3},
    ],
)
def test_inline_saturation_detector_thresholds_are_checked(sd):
    with pytest.raises(ConfigError):
        build_flow_config(None, sd, [])


def test_a_gie_v1_2_config_with_inline_thresholds_loads_through_the_scheduling_section():
    from extproc.config import build_configured_flow_control, examine

    doc = {
        "apiVersion": "inference.networking.x-k8s.io/v1alpha1",
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "default", "plugins": [{"pluginRef": "queue-scorer"},
                                            {"pluginRef": "max-score-picker"}]}
        ],
        "saturationDetector": {"queueDepthThreshold": 8, "kvCacheUtilThreshold": 0.75},
    }  # fmt: skip
    ex = examine({"scheduling": doc})
    assert ex.problems == [] and ex.settings is not None
    fc = build_configured_flow_control(ex.settings)
    assert fc is not None and isinstance(fc.detector, UtilizationDetector)
    assert fc.detector.params.queueDepthThreshold == 8
    bad = {**doc, "saturationDetector": {"queueDepthThreshold": 0}}
    ex = examine({"scheduling": bad})
    assert ex.settings is None
    assert len(ex.problems) == 1 and "Expected `int` >= 1" in str(ex.problems[0])
    assert ex.problems[0].path[-1] == "queueDepthThreshold"
