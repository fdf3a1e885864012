"""Per-endpoint eviction behind a real Envoy: `extproc serve` with `enableEviction`,
`lower-band-eviction-filter` and `flow_control.evict_per_endpoint`, per-endpoint admission
on a concurrency detector of 1000 tokens per server, two upstreams that hold their response
headers (so the requests stay running, their ext_proc streams open).

The sizes leave each request one server with room, so placement is known without asking:
an interactive request (700 tokens) on one server X; batch requests (priority 0) of 500 and
400 on the other, Y, then one of 250 on X (the newest of all). A second interactive request
(300) fits neither (X 1250, Y 1200 with it): it comes closest on Y, so Y's newest batch
request (the 400) is cut, 429 `evicted`, and the interactive request is served on Y at
once, while every other holder runs to its end. llm-d's pool-wide rule would have cut the
newest batch request anywhere (X's 250), and its filter no priority-0 request at all. The
cut request's flow gets its dispatch charge back: its served tokens, and (the batch band
using `program-aware-fairness`) its program's attained service.

Then an interactive request that nothing can make room for (interactive holders on both
servers, no batch running) waits them out: counted `short` once, not once per tick."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.test_flow_control import metric
from tests.e2e.test_flow_eviction import dispatched

CONFIG = {
    "parse": {"bytes_per_token": 4, "calibrate": False},
    "scheduling": {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {
                "type": "concurrency-detector",
                "parameters": {"concurrencyMode": "tokens", "maxTokenConcurrency": 1000},
            },
            {"type": "lower-band-eviction-filter"},
            {"type": "program-aware-fairness"},
        ],
        "flowControl": {
            "defaultRequestTTL": "30s",
            "saturationDetector": {"pluginRef": "concurrency-detector"},
            "priorityBands": [
                {"priority": 10},
                {"priority": 0, "fairnessPolicyRef": "program-aware-fairness"},
            ],
            "enableEviction": True,
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    },
    "flow_control": {"admit_per_endpoint": True, "evict_per_endpoint": True, "retry_after_s": 2},
}
OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: interactive}
spec: {priority: 10}
---
kind: InferenceObjective
metadata: {name: batch}
spec: {priority: 0}
"""
HOLD_MS = 4000  # how long a holder's response headers take: far beyond any eviction


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("evictep")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    config = {**CONFIG, "flow_control": {**CONFIG["flow_control"]}}
    config["flow_control"]["objectives_file"] = str(tmp / "objectives.yaml")
    cfg = tmp / "picker.yaml"
    cfg.write_text(yaml.safe_dump(config))
    with Stack(StackOptions(upstreams=2, extproc_args=("--config", str(cfg)))) as s:
        yield s


def prompt(tag: str, tokens: int) -> str:
    """About `tokens` picker tokens (4 bytes each), no prefix shared with another tag's."""
    word = f"{tag}-w "
    return (word * (tokens * 4 // len(word) + 1))[: tokens * 4]


async def post(
    c: httpx.AsyncClient, objective: str, tag: str, tokens: int, hold_ms: int = 0
) -> httpx.Response:
    """Each request its own fairness ID (its tag): its flow's served tokens can be read."""
    headers = {
        "x-llm-d-inference-objective": objective,
        "x-request-id": tag,
        "x-gateway-inference-fairness-id": tag,
    }
    if hold_ms:
        headers["x-echo-headers-delay-ms"] = str(hold_ms)
    body = {"model": "m", "prompt": prompt(tag, tokens)}
    return await c.post("/v1/completions", json=body, headers=headers)


async def test_a_waiting_interactive_request_cuts_the_newest_batch_on_its_closest_server(
    stack: Stack,
):
    before = metric(stack, "extproc_flow_endpoint_evictions_total", outcome="cut")
    base = dispatched(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        holders = {}
        order = [
            ("hi-x", "interactive", 700),
            ("b-y1", "batch", 500),
            ("b-y2", "batch", 400),
            ("b-x", "batch", 250),
        ]
        for n, (tag, objective, tokens) in enumerate(order):
            holders[tag] = asyncio.create_task(post(c, objective, tag, tokens, HOLD_MS))
            await asyncio.to_thread(
                wait_until, lambda n=n: dispatched(stack) >= base + n + 1, timeout_s=5, what=tag
            )
        # Fairness counts b-y2's tokens as served from its dispatch (the batch band's
        # program-aware fairness its attained service)...
        assert metric(stack, "extproc_flow_fairness_served_tokens", fairness_id="b-y2") > 300
        assert metric(stack, "extproc_flow_program_service_tokens", fairness_id="b-y2") > 300
        hi = asyncio.create_task(post(c, "interactive", "hi-2", 300))
        done, _ = await asyncio.wait((hi, *holders.values()), return_when=asyncio.FIRST_COMPLETED)
        # Y's newest batch request is cut, with llm-d's reason, the interactive one served.
        assert holders["b-y2"] in done, sorted(t for t, task in holders.items() if task in done)
        cut = holders["b-y2"].result()
        assert cut.status_code == 429, cut.text
        assert cut.headers["x-llm-d-request-dropped-reason"] == "evicted"
        assert cut.headers["retry-after"] == "2"
        # ... and no longer once it is cut (its client got no answer); the others keep theirs.
        assert metric(stack, "extproc_flow_fairness_served_tokens", fairness_id="b-y2") == 0
        assert metric(stack, "extproc_flow_fairness_served_tokens", fairness_id="b-y1") > 300
        assert metric(stack, "extproc_flow_program_service_tokens", fairness_id="b-y2") == 0
        assert metric(stack, "extproc_flow_program_service_tokens", fairness_id="b-y1") > 300
        served = await hi
        assert served.status_code == 200
        left = [t for t, task in holders.items() if t != "b-y2" and task.done()]
        assert left == [], f"{left} ended before the interactive request was served"
        # Every other holder (the newest of all, b-x, included) runs to its end.
        by = {t: (await task) for t, task in holders.items() if t != "b-y2"}
    assert all(r.status_code == 200 for r in by.values())
    y = served.headers[SERVED_BY_HEADER]
    assert by["b-y1"].headers[SERVED_BY_HEADER] == y  # served where the room was made
    assert by["hi-x"].headers[SERVED_BY_HEADER] != y
    assert by["b-x"].headers[SERVED_BY_HEADER] != y
    after = metric(stack, "extproc_flow_endpoint_evictions_total", outcome="cut")
    assert after == before + 1
    assert metric(stack, "extproc_flow_requests_total", priority="0",
                  outcome="evicted_inflight") == 1  # fmt: skip


async def test_a_request_nothing_can_make_room_for_counts_short_once(stack: Stack):
    short = metric(stack, "extproc_flow_endpoint_evictions_total", outcome="short")
    cuts = metric(stack, "extproc_flow_endpoint_evictions_total", outcome="cut")
    base = dispatched(stack)
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        holders = []
        for n, tag in enumerate(("hi-h1", "hi-h2")):  # 700 on each server
            holders.append(asyncio.create_task(post(c, "interactive", tag, 700, 1500)))
            await asyncio.to_thread(
                wait_until, lambda n=n: dispatched(stack) >= base + n + 1, timeout_s=5, what=tag
            )
        # 400 fits neither, and only its own band runs there: it waits the holders out
        # (about 1.4 s, some 70 dispatch opportunities at the 20 ms tick).
        waited = await post(c, "interactive", "hi-w", 400)
        assert waited.status_code == 200
        assert all(r.status_code == 200 for r in await asyncio.gather(*holders))
    assert metric(stack, "extproc_flow_endpoint_evictions_total", outcome="short") == short + 1
    assert metric(stack, "extproc_flow_endpoint_evictions_total", outcome="cut") == cuts
