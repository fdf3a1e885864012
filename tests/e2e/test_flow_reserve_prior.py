"""The reserve for a higher band holds before that band has sent anything, behind a real
Envoy: `extproc serve` with per-endpoint admission and `reserve_for_higher_bands: 1`, two
configured bands (interactive 10, batch 0), a token-mode concurrency detector whose ceiling
one request and the room for another exceed, in front of two simulated vLLM servers.

At the start of a burst batch work comes first. Reserving only for the interactive sizes
seen so far (none), batch took the second server too and the first interactive requests
waited in the picker until batch ended. Now a higher band without a full history gets the
room of the largest recent request of any band: with one server streaming a batch answer,
the next batch request is held in the picker, and an interactive request that arrives then
is answered at once by the server kept free."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import distinct_chat
from tests.e2e.flow_configs import held_or_done, queued
from tests.e2e.sim_speed import finish_fast

CONFIG = {
    "parse": {"block_tokens": 16, "bytes_per_token": 4, "calibrate": False},
    "state": {"request_end": {"mode": "access-log"}},  # in flight until the stream ends
    "scheduling": {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            # A prompt here is ~500 estimated tokens (its output is not counted: the
            # detector has no outputTokens): one request in flight plus the room for
            # another exceed 900, one alone does not.
            {
                "type": "concurrency-detector",
                "parameters": {"concurrencyMode": "tokens", "maxTokenConcurrency": 900},
            },
        ],
        "flowControl": {
            "defaultRequestTTL": "60s",
            "priorityBands": [{"priority": 10}, {"priority": 0}],
            "saturationDetector": {"pluginRef": "concurrency-detector"},
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    },
    "flow_control": {"admit_per_endpoint": True, "reserve_for_higher_bands": 1},
}
LONG = 400  # output tokens at 100 tokens/s: the first request streams for ~4 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("flowprior")
    objectives = tmp / "objectives.yaml"
    objectives.write_text(yaml.safe_dump({"interactive": 10, "batch": 0}))
    cfg = dict(CONFIG, flow_control={**CONFIG["flow_control"], "objectives_file": str(objectives)})
    path = tmp / "picker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    sim = ("--decode-tps", "100")
    with Stack(StackOptions(upstreams=2, sim_args=sim, extproc_args=("--config", str(path)))) as s:
        yield s


def body(model: str, seed: int, max_tokens: int) -> dict:
    return distinct_chat(model, seed, max_tokens)


async def test_batch_leaves_a_server_for_interactive_before_any_interactive_came(stack: Stack):
    model = stack.fleet.model
    first_by: asyncio.Future[str] = asyncio.get_running_loop().create_future()
    batch = {"x-llm-d-inference-objective": "batch"}

    async def long_one(c: httpx.AsyncClient) -> int:
        req = body(model, 1, LONG)
        async with c.stream("POST", "/v1/chat/completions", json=req, headers=batch) as r:
            first_by.set_result(r.headers[SERVED_BY_HEADER])
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        first = asyncio.create_task(long_one(c))
        busy = await asyncio.wait_for(first_by, 30)
        second = asyncio.create_task(
            c.post("/v1/chat/completions", json=body(model, 2, 4), headers=batch)
        )
        # Before: placed on the idle server at once (nothing reserved for a band that had
        # sent nothing) and answered. Now: held in the picker while the first streams.
        await held_or_done(stack, second, tries=200, every_s=0.1)
        assert not second.done(), "the second batch request took the server kept free"
        assert not first.done(), "the first request ended before the check"
        hi = await c.post(
            "/v1/chat/completions",
            json=body(model, 3, 4),
            headers={"x-llm-d-inference-objective": "interactive"},
        )
        assert hi.status_code == 200
        assert hi.headers[SERVED_BY_HEADER] != busy  # the server the reserve kept free
        finish_fast(stack.fleet)  # checked: the first ends now, not seconds later
        assert await first == 200
        # The first ended: the batch request is released, nothing is lost.
        assert (await second).status_code == 200
        assert queued(stack, 0) == 0
    # The room kept is exported: at least one request of ~500 estimated tokens.
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    held = re.search(r"^extproc_flow_reserved_tokens (\S+)$", text, re.M)
    assert held is not None and float(held.group(1)) >= 500
    # ... and why the second request waited: the reserve, not a lack of room.
    by_reserve = re.search(r"^extproc_flow_reserve_held_total (\S+)$", text, re.M)
    assert by_reserve is not None and float(by_reserve.group(1)) >= 1
