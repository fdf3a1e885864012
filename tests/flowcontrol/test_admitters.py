"""probabilistic-admitter: llm-d's curve, applied to sheddable requests only."""

from __future__ import annotations

import pytest

from extproc.config import build_configured_flow_control, decode_settings
from extproc.core import EndpointState, InferenceRequest
from extproc.flowcontrol.admission import Admission, Shed
from extproc.flowcontrol.admitters import ProbabilisticAdmitter
from extproc.flowcontrol.objectives import Objectives

fresh = {"age_s": 0.01, "is_stale": False}


def test_curve_and_priorities():
    a = ProbabilisticAdmitter()
    half = [EndpointState(waiting=1, kv_usage=0.0, **fresh)]  # saturation 0.2
    assert a.shed_probability(half) == pytest.approx(min(0.2**5 * 300, 1.0))
    full = [EndpointState(waiting=2, kv_usage=0.4, **fresh)]  # saturation 0.5 -> 1.0
    assert a.shed_probability(full) == 1.0
    assert a.shed_probability([EndpointState()]) == 1.0  # never scraped counts as full
    assert a.shed_probability([]) == 0.0
    assert a.admit(0, full, lambda: 0.0) and a.admit(10, full, lambda: 0.0)
    assert not a.admit(-1, full, lambda: 0.99)
    assert a.admit(-1, half, lambda: 0.99) and not a.admit(-1, half, lambda: 0.0)


async def test_listed_admitter_turns_admission_on_and_sheds_sheddable(tmp_path):
    doc = {
        "kind": "EndpointPickerConfig",
        "plugins": [{"type": "max-score-picker"}, {"type": "probabilistic-admitter"}],
        "schedulingProfiles": [{"name": "d", "plugins": [{"pluginRef": "max-score-picker"}]}],
    }
    cfg = build_configured_flow_control(decode_settings(doc))
    assert cfg is not None and len(cfg.admitters) == 1
    full = [EndpointState(waiting=50, **fresh)]
    adm = Admission(cfg, lambda: full, objectives=Objectives(table={"batch": -1}), rand=lambda: 0.5)
    req = InferenceRequest("r", "/v1/completions", headers={"x-llm-d-inference-objective": "batch"})
    with pytest.raises(Shed) as err:
        await adm.admit(req, 10)
    assert err.value.code == "rejected-saturated" and err.value.status == 429
    assert adm.controller.stats.outcomes[(-1, "default-flow", "rejected_admitter")] == 1
