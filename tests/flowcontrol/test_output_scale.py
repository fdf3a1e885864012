"""`flow_control.output_token_scale`: outputs (counted in real tokens, from the expectation
or the request's cap) scaled into the prompt estimate's unit before they add up with it."""

from __future__ import annotations

import orjson

from extproc.config import decode_settings
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.config import FlowControlSettings, build_flow_config
from extproc.requests.parse import parse_request
from extproc.requests.settings import ParseSettings


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
