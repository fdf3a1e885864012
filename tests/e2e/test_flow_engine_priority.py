"""Engine-side priority behind a real Envoy (`flow_control.engine_priority`): `extproc serve`
sends the request's band to the upstream as its priority (-band).

The body form (`true` / `body`) writes it into the body as `priority`, in both request body
modes (FULL_DUPLEX_STREAMED: the echoed chunks; BUFFERED: a body mutation), with the
content-length the new body has; a client's own `priority` (however spelled) and its
`x-vllm-priority` header are replaced / removed. The header form (`header`) sets
`x-vllm-priority` instead, replacing the client's (sent twice too), and the body arrives
byte for byte as the client sent it, in both modes and in STREAMED, where the picker never
sees the body. With the setting off the body passes as the client sent it.

The echo upstreams answer with the body's top-level `priority` as they parsed it, the
`x-vllm-priority` header (first value and all values) and content-length they received, and
the body's digest."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

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


def streamed(doc: dict[str, Any]) -> dict[str, Any]:
    """The bootstrap with Envoy's request body mode STREAMED: chunks pass the picker, which
    decides on headers alone and never sees the whole body."""
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
    (f,) = [f for f in hcm["typed_config"]["http_filters"] if "ext_proc" in f["name"]]
    mode = f["typed_config"]["processing_mode"]
    mode["request_body_mode"] = "STREAMED"
    mode["request_trailer_mode"] = "SKIP"
    return doc


@pytest.fixture(
    scope="module",
    params=[
        "FULL_DUPLEX_STREAMED",
        "BUFFERED",
        "off",
        "header-FULL_DUPLEX_STREAMED",
        "header-BUFFERED",
        "header-STREAMED",
    ],
)
def stack(request, tmp_path_factory) -> Iterator[tuple[str, Stack]]:
    mode = request.param
    tmp = tmp_path_factory.mktemp("engine-priority")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    setting: bool | str = mode != "off"  # the original boolean spelling: the body form
    if mode.startswith("header-"):
        setting = "header"
    config = {
        # In-flight requests as the saturation signal: the echo upstreams export no metrics.
        "scheduling": in_flight_scheduling(),
        "flow_control": {
            "objectives_file": str(tmp / "objectives.yaml"),
            "engine_priority": setting,
        },
    }
    cfg = tmp / "picker.yaml"
    cfg.write_text(yaml.safe_dump(config))
    body_mode = mode.removeprefix("header-")

    def bootstrap(o):
        if body_mode == "STREAMED":
            return streamed(build_bootstrap(o))
        full = "BUFFERED" if body_mode == "BUFFERED" else "FULL_DUPLEX_STREAMED"
        return build_bootstrap(replace(o, request_body_mode=full))

    opts = StackOptions(upstreams=1, extproc_args=("--config", str(cfg)), bootstrap=bootstrap)
    with Stack(opts) as s:
        yield mode, s


def send(
    s: Stack,
    body: bytes,
    objective: str | None = None,
    extra: tuple[tuple[str, str], ...] = (),
    **headers: str,
) -> dict:
    h = [("content-type", "application/json"), *headers.items(), *extra]
    if objective:
        h.append((OBJECTIVE, objective))
    r = httpx.post(f"{s.url}/v1/chat/completions", content=body, headers=h, timeout=30)
    assert r.status_code == 200, r.text
    seen = r.json()
    assert seen.get("body_json", True), "the upstream got a body that is not JSON"
    # The declared size is the size that arrived (a stale content-length would cut or hang).
    assert seen["content_length"] in (None, str(seen["body_bytes"]))
    return seen


def chat(**extra) -> dict:
    return {"model": "m", "messages": [{"role": "user", "content": "hello"}], **extra}


OUTCOMES = ("inserted", "replaced", "header", "skipped")


def outcomes(s: Stack) -> dict[str, float]:
    return {o: metric(s, "extproc_flow_engine_priority_total", outcome=o) for o in OUTCOMES}


def test_the_header_form_sends_the_band_and_leaves_the_body(stack):
    mode, s = stack
    if not mode.startswith("header-"):
        pytest.skip("the header form")
    before = outcomes(s)

    def untouched(body: bytes, seen: dict) -> None:
        assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
        assert seen["body_bytes"] == len(body)

    body = orjson.dumps(chat())
    seen = send(s, body, "interactive")
    untouched(body, seen)
    assert seen["vllm_priority_headers"] == ["-10"] and "priority" not in seen
    seen = send(s, body)
    assert seen["vllm_priority_headers"] == ["0"]

    # A forged priority in the body (vLLM reads the header first: harmless, left as sent)
    # and in the header, given twice: one value arrives, the band's.
    body = orjson.dumps(chat(priority=-1000))
    forged = (("x-vllm-priority", "-1000"), ("x-vllm-priority", "-999"))
    seen = send(s, body, "batch", extra=forged)
    untouched(body, seen)
    assert seen["vllm_priority_headers"] == ["1"]
    assert seen["priority"] == -1000

    after = outcomes(s)
    assert after["header"] - before["header"] == 3
    assert after["inserted"] == before["inserted"] and after["replaced"] == before["replaced"]


def test_the_band_reaches_the_engine_and_the_client_cannot_choose(stack):
    mode, s = stack
    if mode.startswith("header-"):
        pytest.skip("the body form and off")
    on = mode != "off"
    before = outcomes(s)

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
    header = mode.startswith("header-")
    expected = body if mode == "off" or header else b'{"priority":-10,' + body[1:]
    assert seen["body_bytes"] == len(expected)
    assert seen["body_sha256"] == hashlib.sha256(expected).hexdigest()
    assert seen["vllm_priority_headers"] == (["-10"] if header else [])


def test_an_api_without_the_field_goes_unchanged(stack):
    """Anthropic messages: vLLM's request has no `priority`; the body goes as sent. The body
    form cannot reach the engine (counted `skipped`) but still keeps the client's
    `x-vllm-priority` from it; vLLM serves messages as a chat completion that reads the
    header, so the header form sets it (counted `header`)."""
    mode, s = stack
    body = orjson.dumps({"model": "m", "max_tokens": 5,
                         "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    before = outcomes(s)
    r = httpx.post(f"{s.url}/v1/messages", content=body,
                   headers={"content-type": "application/json", "x-vllm-priority": "-5",
                            OBJECTIVE: "interactive"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    seen = r.json()
    assert seen["body_sha256"] == hashlib.sha256(body).hexdigest()
    after = outcomes(s)
    if mode.startswith("header-"):
        assert seen["vllm_priority_headers"] == ["-10"]
        assert after["header"] == before["header"] + 1
    elif mode != "off":
        assert seen["vllm_priority_headers"] == []
        assert after["skipped"] == before["skipped"] + 1
    else:
        assert seen["vllm_priority_headers"] == ["-5"]
