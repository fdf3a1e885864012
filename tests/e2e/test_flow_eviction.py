"""In-flight eviction behind a real Envoy: `extproc serve` with `enableEviction`, the llm-d
eviction plugins listed by name, a concurrency detector of two slots, and one upstream that
holds its response headers (so the requests stay running, their ext_proc streams open).

A critical request that finds both slots taken by sheddable (priority < 0) requests gets
one of them cut (429 `evicted`, the most recently dispatched one) and is served at once; the
other sheddable request runs to its end. Slots held by non-sheddable requests (priority 0)
are never cut: the critical request waits for one to end. No assertion depends on timing
beyond ordering: the holders run for many seconds, far longer than any eviction takes."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.sim.echo import HEADERS_DELAY_HEADER
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.test_flow_control import metric

CONFIG = {
    "scheduling": {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 2}},
            {"type": "sheddable-eviction-filter"},
            {"type": "priority-then-time-eviction-order-policy"},
        ],
        "flowControl": {
            "defaultRequestTTL": "30s",
            "saturationDetector": {"pluginRef": "concurrency-detector"},
            "enableEviction": True,
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    },
    "flow_control": {"retry_after_s": 2},
}
OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 5}
---
kind: InferenceObjective
metadata: {name: sheddable}
spec: {priority: -1}
"""
HOLD_MS = 6000  # how long a holder's response headers take: far beyond any eviction


@pytest.fixture(scope="module")
def evict_stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("evict")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    config = {**CONFIG, "flow_control": {**CONFIG["flow_control"]}}
    config["flow_control"]["objectives_file"] = str(tmp / "objectives.yaml")
    cfg = tmp / "picker.yaml"
    cfg.write_text(yaml.safe_dump(config))
    with Stack(StackOptions(upstreams=1, extproc_args=("--config", str(cfg)))) as s:
        yield s


async def post(
    c: httpx.AsyncClient, objective: str | None, delay_ms: int = 0, tag: str = ""
) -> httpx.Response:
    headers = {HEADERS_DELAY_HEADER: str(delay_ms)} if delay_ms else {}
    if objective:
        headers["x-llm-d-inference-objective"] = objective
    if tag:
        headers["x-request-id"] = tag
    return await c.post("/v1/completions", json={"model": "m", "prompt": tag}, headers=headers)


def dispatched(stack: Stack) -> float:
    return metric(stack, "extproc_flow_requests_total", outcome="dispatched")


async def test_a_blocked_critical_request_evicts_the_newest_sheddable_one(evict_stack: Stack):
    before = metric(evict_stack, "extproc_flow_requests_total", outcome="evicted_inflight")
    base = dispatched(evict_stack)
    async with httpx.AsyncClient(base_url=evict_stack.url, timeout=60) as c:
        first = asyncio.create_task(post(c, "sheddable", HOLD_MS, "shed-first"))
        await asyncio.to_thread(
            wait_until, lambda: dispatched(evict_stack) >= base + 1, timeout_s=10, what="first"
        )
        second = asyncio.create_task(post(c, "sheddable", HOLD_MS, "shed-second"))
        await asyncio.to_thread(
            wait_until, lambda: dispatched(evict_stack) >= base + 2, timeout_s=10, what="second"
        )
        critical = asyncio.create_task(post(c, "critical", 0, "critical"))
        done, _ = await asyncio.wait((first, second, critical), return_when=asyncio.FIRST_COMPLETED)
        # The newest sheddable request is cut first, with llm-d's reason.
        assert second in done, [t.get_name() for t in done]
        cut = second.result()
        assert cut.status_code == 429, cut.text
        assert cut.headers["x-llm-d-request-dropped-reason"] == "evicted"
        assert cut.headers["retry-after"] == "2"
        # The critical request takes its slot without waiting for a holder to end.
        served = await critical
        assert served.status_code == 200
        assert not first.done()
        # The older sheddable request was not cut: it runs to its end.
        assert (await first).status_code == 200
    after = metric(evict_stack, "extproc_flow_requests_total", outcome="evicted_inflight")
    assert after == before + 1
    assert metric(evict_stack, "extproc_flow_requests_total", priority="-1",
                  outcome="evicted_inflight") >= 1  # fmt: skip


async def test_non_sheddable_requests_are_never_evicted(evict_stack: Stack):
    before = metric(evict_stack, "extproc_flow_requests_total", outcome="evicted_inflight")
    base = dispatched(evict_stack)
    async with httpx.AsyncClient(base_url=evict_stack.url, timeout=60) as c:
        holders = [asyncio.create_task(post(c, None, 2500, f"normal-{i}")) for i in range(2)]
        await asyncio.to_thread(
            wait_until, lambda: dispatched(evict_stack) >= base + 2, timeout_s=10, what="holders"
        )
        critical = asyncio.create_task(post(c, "critical", 0, "critical-2"))
        done, _ = await asyncio.wait((*holders, critical), return_when=asyncio.FIRST_COMPLETED)
        # A holder ends first (it was not cut): the critical request waited for its slot.
        assert critical not in done
        assert [r.status_code for r in await asyncio.gather(*holders)] == [200, 200]
        assert (await critical).status_code == 200
    assert metric(evict_stack, "extproc_flow_requests_total", outcome="evicted_inflight") == before
