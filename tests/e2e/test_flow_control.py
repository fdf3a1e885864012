"""Flow control behind a real Envoy: `extproc serve` with a concurrency detector of two
slots in front of one upstream whose responses take a while. Past capacity requests are held
in the picker and served when a slot frees; past the queue bound they get 429 with the
reason and retry-after; past the TTL they get 429 rejected-ttl-expired; a client that gives
up leaves the queue at once."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.sim.echo import HEADERS_DELAY_HEADER
from extproc.stack import Stack, StackOptions, wait_until

CONFIG = {
    "scheduling": {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 2}},
        ],
        "flowControl": {
            "defaultRequestTTL": "2s",
            "priorityBands": [{"priority": 0, "maxRequests": 3}],
            "saturationDetector": {"pluginRef": "concurrency-detector"},
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    },
    "flow_control": {"retry_after_s": 3},
}
OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 5}
"""


@pytest.fixture(scope="module")
def flow_stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("flow")
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    config = {**CONFIG, "flow_control": {**CONFIG["flow_control"]}}
    config["flow_control"]["objectives_file"] = str(tmp / "objectives.yaml")
    cfg = tmp / "picker.yaml"
    cfg.write_text(yaml.safe_dump(config))
    with Stack(StackOptions(upstreams=1, extproc_args=("--config", str(cfg)))) as s:
        yield s


def metric(stack: Stack, name: str, **labels: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', line.partition("}")[0]))
        if all(got.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


async def post(
    client: httpx.AsyncClient, delay_ms: int = 0, objective: str | None = None, **kw
) -> httpx.Response:
    headers = {HEADERS_DELAY_HEADER: str(delay_ms)} if delay_ms else {}
    if objective:
        headers["x-llm-d-inference-objective"] = objective
    return await client.post(
        "/v1/completions", json={"model": "m", "prompt": "hello"}, headers=headers, **kw
    )


async def test_overload_queues_then_serves_and_sheds_with_reasons(flow_stack: Stack):
    async with httpx.AsyncClient(base_url=flow_stack.url, timeout=30) as c:
        # Two slots taken for ~1 s; three more wait in the queue (its bound); a sixth is shed.
        holders = [asyncio.create_task(post(c, delay_ms=1000)) for _ in range(2)]
        await asyncio.sleep(0.3)
        start = time.monotonic()
        queued = [asyncio.create_task(post(c)) for _ in range(3)]
        await asyncio.sleep(0.3)
        shed = await post(c)
        assert shed.status_code == 429, shed.text
        assert shed.headers["x-llm-d-request-dropped-reason"] == "rejected-saturated"
        assert shed.headers["retry-after"] == "3"
        assert shed.json()["error"]["code"] == "rejected-saturated"
        done = await asyncio.gather(*holders, *queued)
        assert [r.status_code for r in done] == [200] * 5
        # The queued ones really waited for a slot (held while the holders ran).
        assert time.monotonic() - start > 0.5
    assert metric(flow_stack, "extproc_flow_requests_total", outcome="rejected_capacity") == 1
    assert metric(flow_stack, "extproc_flow_requests_total", outcome="dispatched") >= 5
    assert metric(flow_stack, "extproc_flow_queue_wait_seconds_count") >= 5


async def test_ttl_expiry_and_a_client_that_leaves(flow_stack: Stack):
    before = metric(flow_stack, "extproc_flow_requests_total", outcome="cancelled")
    async with httpx.AsyncClient(base_url=flow_stack.url, timeout=30) as c:
        holders = [asyncio.create_task(post(c, delay_ms=3500)) for _ in range(2)]
        await asyncio.sleep(0.3)
        # This client gives up after 0.5 s: its request must leave the queue then.
        with pytest.raises(httpx.TimeoutException):
            await post(c, timeout=0.5)
        wait_until(
            lambda: (
                metric(flow_stack, "extproc_flow_requests_total", outcome="cancelled") == before + 1
            ),
            timeout_s=5,
            what="the cancelled request counted",
        )
        assert metric(flow_stack, "extproc_flow_queue_requests") == 0
        # This one waits out the 2 s TTL while the holders keep both slots.
        expired = await post(c)
        assert expired.status_code == 429
        assert expired.headers["x-llm-d-request-dropped-reason"] == "rejected-ttl-expired"
        assert [r.status_code for r in await asyncio.gather(*holders)] == [200, 200]


async def test_higher_priority_objective_is_served_first(flow_stack: Stack):
    async with httpx.AsyncClient(base_url=flow_stack.url, timeout=30) as c:
        short = asyncio.create_task(post(c, delay_ms=800))
        long = asyncio.create_task(post(c, delay_ms=2500))
        await asyncio.sleep(0.3)
        order: list[str] = []

        async def tagged(name: str, **kw) -> None:
            r = await post(c, **kw)
            assert r.status_code == 200
            order.append(name)

        low = asyncio.create_task(tagged("low"))
        await asyncio.sleep(0.2)
        high = asyncio.create_task(tagged("critical", objective="critical"))
        await asyncio.gather(short, long, low, high)
    # Queued in that order, released in priority order when the first slot freed.
    assert order == ["critical", "low"]
