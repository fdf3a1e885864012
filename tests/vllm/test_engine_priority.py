"""Engine-side priority against a real vLLM (`--scheduling-policy priority`).

The body form, on the session fleet: `extproc serve` behind Envoy with
`flow_control.engine_priority` writes each request's band into the body as `priority`, and
the engine accepts what arrives. The proof that the engine parsed the picker's value and
not the client's: a client `priority` that is not an integer, which vLLM refuses (400,
`int_parsing`, checked directly against a server), is answered 200 through the picker
because it was replaced; a non-integer `x-vllm-priority` header (which vLLM reads before the
body) is removed.

The header form's ordering on a one-slot engine is not tested here: the test written for it
(tenth session) was conclusive only when both queued requests reached the engine inside the
holder's run, and behind the picker's flow control a request could also wait past the
gateway's message timeout (503 picker_unavailable). Its design is in bench/RESULTS.md
(issue 15, tenth session, engine priority as a header)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.stack import Stack, StackOptions
from tests.e2e.flow_configs import in_flight_scheduling
from tests.vllm.conftest import picker_config
from tests.vllm.fleet import MODEL_NAME, VllmFleet

OBJECTIVES = "interactive: 10\nbatch: -1\n"


@pytest.fixture(scope="module")
def priority_stack(vllm_fleet: VllmFleet, tmp_path_factory) -> Iterator[Stack]:
    tmp: Path = tmp_path_factory.mktemp("engine-priority")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    scheduling = in_flight_scheduling()
    flow = {"objectives_file": str(tmp / "objectives.yaml"), "engine_priority": True}
    cfg = picker_config(vllm_fleet, tmp / "picker.yaml", scheduling=scheduling, flow_control=flow)
    opts = StackOptions(fleet=vllm_fleet, extproc_args=("--config", str(cfg)))  # type: ignore[arg-type]
    with Stack(opts) as stack:
        yield stack


def test_a_real_engine_takes_the_band_not_the_clients_priority(
    vllm_fleet: VllmFleet, priority_stack: Stack
):
    chat = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "hello engine priority"}],
        "max_tokens": 3,
        "priority": "first please",
    }
    direct = httpx.post(f"{vllm_fleet.servers[0].url}/v1/chat/completions", json=chat, timeout=60)
    assert direct.status_code == 400, direct.text  # the engine refuses the client's value
    url = f"{priority_stack.url}/v1/chat/completions"
    for objective in ("interactive", "batch", None):
        headers = {"x-vllm-priority": "not a number"}
        if objective:
            headers["x-llm-d-inference-objective"] = objective
        r = httpx.post(url, json=chat, headers=headers, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 3
    # Completions without a client priority: the band's is inserted.
    body = {"model": MODEL_NAME, "prompt": "inserted priority", "max_tokens": 2}
    r = httpx.post(f"{priority_stack.url}/v1/completions", json=body,
                   headers={"x-llm-d-inference-objective": "interactive"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
