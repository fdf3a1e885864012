"""Profile handlers: plain serving and disaggregated prefill/decode/encode."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from extproc.config import build_configured_scheduler, decode_settings
from extproc.errors import ConfigError
from extproc.scheduling.handlers import ENCODERS_HEADER, PREFILLER_HEADER
from tests.scheduling.helpers import cand, req

DISAGG = textwrap.dedent(
    """\
    kind: EndpointPickerConfig
    plugins:
    - type: disagg-profile-handler
      parameters:
        maxEncoders: 2
        deciders: {prefill: pd-decider, encode: always-disagg-multimodal-decider}
    - type: prefix-based-pd-decider
      name: pd-decider
      parameters: {nonCachedTokens: 257}
    - type: always-disagg-multimodal-decider
    - type: decode-filter
    - type: prefill-filter
    - type: encode-filter
    - type: prefix-cache-scorer
    - type: active-request-scorer
    schedulingProfiles:
    - name: decode
      plugins: [{pluginRef: decode-filter}, {pluginRef: prefix-cache-scorer, weight: 3},
                {pluginRef: active-request-scorer}]
    - name: prefill
      plugins: [{pluginRef: prefill-filter}, {pluginRef: active-request-scorer}]
    - name: encode
      plugins: [{pluginRef: encode-filter}, {pluginRef: active-request-scorer}]
    """
)


def scheduler(text: str = DISAGG):
    return build_configured_scheduler(decode_settings(yaml.safe_load(text)))


FLEET = [
    cand("10.0.0.1:8000", role="decode"),
    cand("10.0.0.2:8000", role="decode"),
    cand("10.0.1.1:8000", role="prefill"),
    cand("10.0.2.1:8000", role="encode"),
    cand("10.0.2.2:8000", role="encode"),
]


def test_short_text_prompt_goes_to_decode_only():
    d = scheduler().schedule(req(blocks=2, tokens=100), FLEET)
    assert d.primary.address.startswith("10.0.0.")
    assert PREFILLER_HEADER not in d.headers
    assert ENCODERS_HEADER not in d.headers
    assert d.prefill is None and d.encoders == ()


def test_long_uncached_prompt_gets_a_prefiller():
    d = scheduler().schedule(req(blocks=20, tokens=1280), FLEET)
    assert d.primary.address.startswith("10.0.0.")
    assert d.headers[PREFILLER_HEADER] == "10.0.1.1:8000"
    assert d.prefill is not None and d.prefill.address == "10.0.1.1:8000"


def test_long_prompt_mostly_cached_on_the_decode_pick_skips_prefill():
    fleet = [cand("10.0.0.1:8000", role="decode", prefix=18), *FLEET[1:]]
    d = scheduler().schedule(req(blocks=20, tokens=1280), fleet)
    assert d.primary.address == "10.0.0.1:8000"  # cache affinity
    assert PREFILLER_HEADER not in d.headers  # 2 uncached blocks x 64 tokens <= 256


def test_media_requests_get_encoders_and_text_requests_never_do():
    d = scheduler().schedule(req(blocks=2, tokens=100, media=("img",)), FLEET)
    assert sorted(d.headers[ENCODERS_HEADER].split(",")) == ["10.0.2.1:8000", "10.0.2.2:8000"]
    for _ in range(20):
        assert ENCODERS_HEADER not in scheduler().schedule(req(blocks=2, tokens=100), FLEET).headers


def test_disagg_without_prefill_or_encode_profiles_is_plain_decode():
    text = DISAGG.split("- name: prefill")[0]
    d = scheduler(text).schedule(req(blocks=20, tokens=5000, media=("i",)), FLEET)
    assert d.headers == {}
    assert d.primary.address.startswith("10.0.0.")


def test_explanation_lists_scores_of_every_profile_that_ran():
    d = scheduler().schedule(req(blocks=20, tokens=1280), FLEET, explain=True)
    assert "decode/prefix-cache-scorer" in d.scores
    assert "prefill/active-request-scorer" in d.scores
    assert any("decode/decode-filter removed" in r for r in d.reasons)


def test_disagg_params_are_strict():
    with pytest.raises(ConfigError, match="maxEncoder"):
        scheduler(DISAGG.replace("maxEncoders: 2", "maxEncoder: 2"))


def test_extprocs_older_threshold_parameter_is_an_implicit_prefix_decider():
    """`threshold: 256` (extproc's older spelling) behaves as nonCachedTokens 257."""
    text = DISAGG.replace(
        "deciders: {prefill: pd-decider, encode: always-disagg-multimodal-decider}",
        "threshold: 256",
    )
    s = scheduler(text)
    assert s.schedule(req(blocks=20, tokens=1280), FLEET).prefill is not None
    fleet = [cand("10.0.0.1:8000", role="decode", prefix=18), *FLEET[1:]]
    assert s.schedule(req(blocks=20, tokens=1280), fleet).prefill is None


def test_without_deciders_no_stage_runs_as_in_llm_d():
    text = DISAGG.replace(
        "\n    deciders: {prefill: pd-decider, encode: always-disagg-multimodal-decider}", ""
    )
    d = scheduler(text).schedule(req(blocks=20, tokens=5000, media=("i",)), FLEET)
    assert d.headers == {} and d.primary.address.startswith("10.0.0.")


def test_a_decider_name_that_is_no_plugin_is_a_config_error():
    with pytest.raises(ConfigError, match="pd-decidr"):
        scheduler(DISAGG.replace("prefill: pd-decider", "prefill: pd-decidr"))
