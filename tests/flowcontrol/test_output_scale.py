"""`flow_control.output_token_scale`: outputs (counted in real tokens, from the expectation
or the request's cap) scaled into the prompt estimate's unit before they add up with it;
configured, or `auto`: measured by calibration (flowcontrol/output_scale.py)."""

from __future__ import annotations

import orjson

from extproc.config import decode_settings
from extproc.core import Endpoint, LatencyTotals
from extproc.endpoints.exposition import Scraped
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.config import FlowControlSettings, build_flow_config
from extproc.flowcontrol.output_scale import SCALE_BOUNDS, OutputScale
from extproc.requests.parse import parse_request
from extproc.requests.settings import ParseSettings
from extproc.server.assembly import Parts


def test_output_token_scale_counts_outputs_in_the_estimates_unit():
    """`output_token_scale`: the output counted (the expectation, or the request's lower
    cap) times the scale, in the request's tokens and its output part alike."""
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 100}
    req = parse_request("/v1/chat/completions", {}, orjson.dumps(body), ParseSettings())

    def counted(**settings: float) -> tuple[int, int]:
        s = FlowControlSettings(expected_output_tokens=160, **settings)  # type: ignore[arg-type]
        flow = Admission(build_flow_config(None, None, [], s), lambda: (), registry=None)
        r = flow.flow_request(req, 500)
        return r.tokens, r.output_tokens

    assert counted() == (600, 100)
    assert counted(output_token_scale=1.28) == (628, 128)
    assert decode_settings({"flow_control": {}}).flow_control.output_token_scale == 1.0
    auto = decode_settings({"flow_control": {"output_token_scale": "auto"}})
    assert auto.flow_control.output_token_scale == "auto"


def test_a_configured_scale_is_said_as_configured():
    scale = OutputScale(1.28)
    scale.measured({"a": 0.5})  # a measurement changes nothing configured
    assert (scale.value, scale.source) == (1.28, "configured")


def test_auto_counts_outputs_one_to_one_until_measured_and_says_so():
    scale = OutputScale("auto")
    assert (scale.value, scale.source) == (1.0, "unmeasured")
    scale.measured({})  # no window closed yet
    assert scale.source == "unmeasured"
    # Engine prompt tokens per estimate, per endpoint: the scale is the median's inverse.
    scale.measured({"a": 0.78, "b": 0.80, "c": 0.50})
    assert scale.source == "measured" and abs(scale.value - 1 / 0.78) < 1e-9
    first = scale.value
    scale.measured({"a": 0.785})  # within a percent: the unit stays put
    assert scale.value == first
    scale.measured({"a": 0.70})
    assert abs(scale.value - 1 / 0.70) < 1e-9
    scale.measured({"a": 100.0})  # clamped into the setting's bounds
    assert scale.value == SCALE_BOUNDS[0]


def test_precise_keys_count_real_tokens():
    scale = OutputScale("auto")
    scale.exact()
    scale.measured({"a": 0.5})
    assert (scale.value, scale.source) == (1.0, "exact")


def test_auto_follows_calibration_through_the_app_and_shows_in_the_metrics():
    """The app feeds calibration's ratios to flow control at every scrape: a request
    admitted after the first window counts its output in the estimate's unit, and
    /metrics names the scale and its source."""
    settings = decode_settings(
        {"parse": {"bytes_per_token": 1}, "flow_control": {"output_token_scale": "auto"}}
    )
    parts = Parts(settings, [Endpoint("10.0.0.1:8000")])
    admission = parts.admission
    assert admission is not None
    body = {"model": "m", "prompt": "x" * 4000, "max_tokens": 100}
    req = parts.calibration("/v1/completions", {}, orjson.dumps(body))
    assert req.prompt_tokens == 4000
    assert admission.flow_request(req, 0).output_tokens == 100
    assert scale_metric(admission) == {"unmeasured": 1.0}

    def scrape(prompt_sum: int, count: int) -> None:
        totals = LatencyTotals(prompt_sum=prompt_sum, prompt_count=count)
        parts._scraped("10.0.0.1:8000", Scraped(prompt_tokens=prompt_sum, latency=totals))

    scrape(0, 0)  # opens the window
    for _ in range(8):
        parts.calibration.placed("10.0.0.1:8000", req)
    scrape(25_000, 8)  # the engine counted 25,000 tokens for our 32,000: 1.28 per token
    assert admission.flow_request(req, 0).output_tokens == 128
    assert scale_metric(admission) == {"measured": 1.28}


def scale_metric(admission: Admission) -> dict[str, float]:
    (family,) = [f for f in admission.collect() if f.name == "extproc_flow_output_token_scale"]
    return {s.labels["source"]: s.value for s in family.samples}
