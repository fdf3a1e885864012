"""Engine-side priority behind a real Envoy (`flow_control.engine_priority`): `extproc serve`
writes the request's band into the body the upstream receives as `priority` (-band), in
both request body modes (FULL_DUPLEX_STREAMED: the echoed chunks; BUFFERED: a body
mutation), with the content-length the new body has. A client's own `priority` (however
spelled) and its `x-vllm-priority` header are replaced / removed. With the setting off the
body passes as the client sent it.

The echo upstreams answer with the body's top-level `priority` as they parsed it, the
`x-vllm-priority` header and content-length they received, and the body's digest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace

import httpx
import orjson
import pytest
import yaml

from extproc.bootstrap import build_bootstrap
from extproc.stack import Stack, StackOptions
from tests.e2e.flow_configs import in_flight_scheduling
from tests.e2e.test_flow_control import metric

OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: interactive}
spec: {priority: 10}
---
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: -1}
"""
OBJECTIVE = "x-llm-d-inference-objective"


@pytest.fixture(scope="module", params=["FULL_DUPLEX_STREAMED", "BUFFERED", "off"])
def stack(request, tmp_path_factory) -> Iterator[tuple[str, Stack]]:
    mode = request.param
    tmp = tmp_path_factory.mktemp("engine-priority")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    config = {
        # In-flight requests as the saturation signal: the echo upstreams export no metrics.
        "scheduling": in_flight_scheduling(),
        "flow_control": {
            "objectives_file": str(tmp / "objectives.yaml"),
            "engine_priority": mode != "off",
        },
    }
    cfg = tmp / "picker.yaml"
    cfg.write_text(yaml.safe_dump(config))
    body_mode = "BUFFERED" if mode == "BUFFERED" else "FULL_DUPLEX_STREAMED"
    opts = StackOptions(
        upstreams=1,
        extproc_args=("--config", str(cfg)),
        bootstrap=lambda o: build_bootstrap(replace(o, request_body_mode=body_mode)),
    )
    with Stack(opts) as s:
        yield mode, s


def send(s: Stack, body: bytes, objective: str | None = None, **headers: str) -> dict:
    h = {"content-type": "application/json", **headers}
    if objective:
        h[OBJECTIVE] = objective
    r = httpx.post(f"{s.url}/v1/chat/completions", content=body, headers=h, timeout=30)
    assert r.status_code == 200, r.text
    seen = r.json()
    assert seen.get("body_json", True), "the upstream got a body that is not JSON"
    # The declared size is the size that arrived (a stale content-length would cut or hang).
    assert seen["content_length"] in (None, str(seen["body_bytes"]))
    return seen


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}


def test_the_band_reaches_the_engine_and_the_client_cannot_choose(stack):
    mode, s = stack
    on = mode != "off"
    before = {o: metric(s, "extproc_flow_engine_priority_total", outcome=o) for o in
              ("inserted", "replaced", "skipped")}  # fmt: skip

    # No client priority: the band's is inserted (interactive 10 -> -10, default 0 -> 0).
    seen = send(s, orjson.dumps(chat()), "interactive")
    assert seen.get("priority") == (-10 if on else None)
    seen = send(s, orjson.dumps(chat()))
    assert seen.get("priority") == (0 if on else None)

    # A forged priority, in the body and in vLLM's header (which vLLM reads first).
    seen = send(s, orjson.dumps(chat(priority=-1000)), "batch", **{"x-vllm-priority": "-1000"})
    if on:
        assert seen["priority"] == 1
        assert seen["vllm_priority_header"] is None
    else:
        assert seen["priority"] == -1000
        assert seen["vllm_priority_header"] == "-1000"

    # Spelled with an escape and given twice: a JSON parser reads both as `priority`.
    forged = b'{"model":"m","priorit\\u0079":-7,"messages":[{"role":"user","content":"x"}],' \
             b'"priority":-8}'  # fmt: skip
    seen = send(s, forged, "interactive")
    assert seen["priority"] == (-10 if on else -8)

    if on:
        after = {o: metric(s, "extproc_flow_engine_priority_total", outcome=o) for o in before}
        assert after["inserted"] - before["inserted"] == 2
        assert after["replaced"] - before["replaced"] == 2


def test_a_large_body_arrives_whole_with_the_band(stack):
    """Several echoed chunks (FULL_DUPLEX_STREAMED sends <= 62,000 bytes each): the field
    goes ahead of the untouched body, every byte of which arrives."""
    mode, s = stack
    body = orjson.dumps(chat(messages=[{"role": "user", "content": "x" * 400_000}]))
    seen = send(s, body, "interactive")
    expected = body if mode == "off" else b'{"priority":-10,' + body[1:]
    assert seen["body_bytes"] == len(expected)
    assert seen["body_sha256"] == hashlib.sha256(expected).hexdigest()


def test_an_api_without_the_field_goes_unchanged(stack):
    """Anthropic messages: vLLM's request has no `priority`; the body goes as sent (counted
    `skipped`), but the client's `x-vllm-priority` still does not reach the engine."""
    mode, s = stack
    body = orjson.dumps({"model": "m", "max_tokens": 5,
                         "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    before = metric(s, "extproc_flow_engine_priority_total", outcome="skipped")
    r = httpx.post(f"{s.url}/v1/messages", content=body,
                   headers={"content-type": "application/json", "x-vllm-priority": "-5"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    seen = r.json()
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
    if mode != "off":
        assert seen["vllm_priority_header"] is None
        assert metric(s, "extproc_flow_engine_priority_total", outcome="skipped") == before + 1
