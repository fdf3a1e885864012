"""Flow control follows a change of the estimates' unit: approximate mode's calibration may
change bytes per token at run time, after which every prompt estimate is `factor` times what
it was. What is a ratio of the estimate follows (the concurrency detector's kvCacheFraction,
count_engine_blocks' fraction, prior and ratio, the output token scale); the in-flight
prompts are counted in the new unit and each placement gives back its share of it; counts
the operator sets in tokens stay as given."""

from __future__ import annotations

import logging

import pytest
from redis.asyncio import Redis

from extproc.config import decode_settings
from extproc.core import Endpoint, EndpointState
from extproc.endpoints.inflight import InFlight
from extproc.endpoints.shared_inflight import SharedInFlight, SharedInFlightSettings
from extproc.flowcontrol.detectors import ConcurrencyDetector
from extproc.flowcontrol.engine_blocks import EngineBlocks
from extproc.flowcontrol.output_scale import OutputScale
from extproc.server.assembly import Parts
from tests.e2e.flow_configs import in_flight_scheduling
from tests.redis_servers import free_port

BLOCKS, BLOCK = 64, 16  # 1,024 engine KV tokens


def kv_state(tokens: int, requests: int = 1) -> EndpointState:
    return EndpointState(
        inflight_requests=requests, inflight_tokens=tokens, kv_blocks=BLOCKS, kv_block_size=BLOCK
    )


def test_the_detectors_ceiling_follows_the_estimates_unit():
    d = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", kvCacheFraction=1.25)
    )
    full = kv_state(round(1.25 * BLOCKS * BLOCK))
    assert d.kv_fraction == 1.25
    assert d.endpoint_saturation(full, 0, 0) == pytest.approx(1.0)
    # 4 -> 2 bytes per token: the same prompts are twice the estimated tokens, and so is
    # the ceiling; the frozen params keep what the operator configured.
    d.units_changed(2.0)
    assert d.kv_fraction == 2.5 and d.params.kvCacheFraction == 1.25
    assert d.endpoint_saturation(full, 0, 0) == pytest.approx(0.5)
    assert d.saturation([full], 0, 0) == pytest.approx(0.5)
    d.units_changed(0.5)  # and back
    assert d.kv_fraction == 1.25
    assert d.endpoint_saturation(full, 0, 0) == pytest.approx(1.0)


def test_a_hand_set_token_ceiling_stays_as_given():
    d = ConcurrencyDetector(
        ConcurrencyDetector.Params(concurrencyMode="tokens", maxTokenConcurrency=1000)
    )
    d.units_changed(2.0)
    assert d.kv_fraction == 0.0
    assert d.endpoint_saturation(kv_state(500), 0, 0) == pytest.approx(0.5)
    requests = ConcurrencyDetector(ConcurrencyDetector.Params(kvCacheFraction=1.25))
    requests.units_changed(2.0)
    assert requests.kv_fraction == 0.0  # requests mode: no token ceiling at all


def test_engine_blocks_fraction_prior_and_ratio_follow_the_unit():
    eb = EngineBlocks(True, 1.25)
    eb.measured({}, BLOCK)
    # At the prior (0.8 engine tokens per estimated one): 100 estimated = 80 engine + 20
    # output, 99 written -> 7 blocks = 112 engine tokens -> 140 estimated.
    assert eb.tokens(100, 20) == 140
    eb.units_changed(2.0)
    assert (eb.fraction, eb.prior) == (2.5, 0.4)
    # The same prompt is 200 estimated tokens now: the same 7 blocks, 2.5 estimated each.
    assert eb.tokens(200, 20) == 280
    eb.measured({"a": 0.8}, BLOCK)
    eb.units_changed(0.5)
    assert eb.per_estimate == pytest.approx(1.6) and eb.fraction == 1.25
    off = EngineBlocks(False, 0.0)
    off.units_changed(2.0)
    assert (off.fraction, off.prior) == (0.0, 0.0)


def test_the_output_scale_follows_when_it_states_a_unit():
    configured, auto = OutputScale(1.28), OutputScale("auto")
    configured.units_changed(2.0)
    auto.units_changed(2.0)
    assert configured.value == pytest.approx(2.56)
    assert (auto.value, auto.source) == (1.0, "unmeasured")  # no unit stated: stays 1:1
    auto.measured({"a": 0.78})
    auto.units_changed(2.0)
    assert auto.value == pytest.approx(2 / 0.78)
    auto.measured({"a": 0.39})  # calibration's ratio carried over alike: no step
    assert auto.value == pytest.approx(2 / 0.78)


def shared_without_redis() -> SharedInFlight:
    # The hot path never touches Redis: no exchange loop runs here.
    return SharedInFlight(Redis(port=free_port()), SharedInFlightSettings())


@pytest.mark.parametrize("counter", [InFlight, shared_without_redis])
def test_in_flight_prompts_are_counted_in_the_new_unit_and_given_back_in_it(counter):
    a = "10.0.0.1:8000"
    inflight = counter()
    before = [inflight.acquire(a, 101), inflight.acquire(a, 7)]
    inflight.units_changed(2.0)
    assert inflight.tokens(a) == 216
    after = inflight.acquire(a, 50)
    inflight.release(before[0])  # gives back 202: what it counts for now
    assert (inflight.requests(a), inflight.tokens(a)) == (2, 64)
    inflight.units_changed(1 / 3)  # a factor that does not divide evenly
    assert inflight.tokens(a) == 21
    inflight.release(after)
    inflight.release(before[1])
    assert (inflight.requests(a), inflight.tokens(a), inflight.total()) == (0, 0, 0)


def parts(fraction: float = 1.25, **flow: object) -> Parts:
    scheduling = in_flight_scheduling()
    detector = {"concurrencyMode": "tokens", "kvCacheFraction": fraction}
    scheduling["plugins"][2]["parameters"] = detector
    settings = decode_settings(
        {
            "parse": {"bytes_per_token": 4},
            "flow_control": {"admit_per_endpoint": True, **flow},
            "scheduling": scheduling,
        }
    )
    return Parts(settings, [Endpoint("10.0.0.1:8000")])


def test_a_recalibration_reaches_flow_control_through_the_assembly(caplog):
    """The assembled server: a bytes-per-token change (here a peer's, adopted) rescales the
    router's in-flight prompts and flow control's ratios, says so in a log line, and the
    effective fraction shows in its gauge."""
    p = parts(count_engine_blocks=True, output_token_scale=1.28)
    admission = p.admission
    assert admission is not None
    assert fraction_metric(admission) == 1.25
    placed = p.router.inflight.acquire("10.0.0.1:8000", 1000)
    with caplog.at_level(logging.INFO, logger="extproc.flowcontrol"):
        assert p.calibration.adopt(2, 4, source="a peer")
    assert "token estimates now 2x" in caplog.text and "2.500 in the new unit" in caplog.text
    assert fraction_metric(admission) == 2.5
    assert admission.engine_blocks.prior == 0.4
    assert admission.output_scale.value == pytest.approx(2.56)
    assert p.router.inflight.tokens("10.0.0.1:8000") == 2000
    p.router.inflight.release(placed)
    assert p.router.inflight.tokens("10.0.0.1:8000") == 0


def test_without_a_kv_fraction_no_gauge_and_the_log_says_so(caplog):
    p = parts(fraction=0.0)
    assert p.admission is not None
    assert fraction_metric(p.admission) is None
    with caplog.at_level(logging.INFO, logger="extproc.flowcontrol"):
        assert p.calibration.adopt(2, 4, source="a peer")
    assert "kvCacheFraction not used" in caplog.text
    assert fraction_metric(p.admission) is None


def fraction_metric(admission) -> float | None:
    found = [f for f in admission.collect() if f.name == "extproc_flow_detector_kv_fraction"]
    return found[0].samples[0].value if found else None
