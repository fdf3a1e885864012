"""Fleet-wide flow control behind a real Envoy: two `extproc serve` replicas sharing one
Redis (index, in-flight counts, flow state), one upstream with a single slot (concurrency
detector), weighted-token fairness A:B = 3:1. Envoy spreads each tenant's requests over
both replicas as it likes; the shares must come out as with one replica: while both tenants
are backlogged, A gets 3 of every 4 slots.

Deterministic by construction: every request holds the one slot for a long time compared
with the replicas' exchange intervals (50-100 ms), so the order of dispatches is decided by
the shared state, not by which replica happens to look first. The assertion has one request
of margin on 8."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.sim.echo import HEADERS_DELAY_HEADER
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.test_flow_control import metric
from tests.redis_servers import RedisServer

HOLD_MS = 700  # each request's slot time: many exchange intervals

CONFIG = {
    "scheduling": {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 1}},
            {"type": "weighted-token-fairness-policy"},
        ],
        "flowControl": {
            "defaultRequestTTL": "60s",
            "priorityBands": [
                {"priority": 0, "fairnessPolicyRef": "weighted-token-fairness-policy"}
            ],
            "saturationDetector": {"pluginRef": "concurrency-detector"},
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    },
    "flow_control": {"fairness_weights": {"A": 3, "B": 1}, "usage_half_life_s": 0},
}


@pytest.fixture
def two_replicas(tmp_path, redis_server: RedisServer) -> Iterator[Stack]:
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    opts = StackOptions(
        upstreams=1, replicas=2, redis_url=redis_server.url, extproc_args=("--config", str(cfg))
    )
    with Stack(opts) as s:
        yield s


async def post(c: httpx.AsyncClient, tenant: str, delay_ms: int) -> httpx.Response:
    # Distinct prompts of one length: the same token cost, no prefix shared with another.
    prompt = secrets.token_hex(64)
    headers = {HEADERS_DELAY_HEADER: str(delay_ms), "x-llm-d-inference-fairness-id": tenant}
    return await c.post("/v1/completions", json={"model": "m", "prompt": prompt}, headers=headers)


def peers_seen(stack: Stack) -> float:
    return metric(stack, "extproc_flow_shared_peers")


async def test_two_replicas_give_one_replicas_token_shares(two_replicas: Stack):
    stack = two_replicas
    wait_until(lambda: peers_seen(stack) == 1, timeout_s=20, what="the replicas see each other")
    order: list[str] = []
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:

        async def tagged(tenant: str) -> None:
            r = await post(c, tenant, HOLD_MS)
            assert r.status_code == 200, r.text
            order.append(tenant)

        holder = asyncio.create_task(post(c, "H", 2 * HOLD_MS))
        await asyncio.sleep(0.3)
        # Both tenants backlogged: 8 each, arriving interleaved at both replicas.
        tasks = [asyncio.create_task(tagged(t)) for _ in range(8) for t in "AB"]
        await asyncio.gather(holder, *tasks)
    first = order[:8]  # while both tenants still have requests queued
    assert 5 <= first.count("A") <= 7, order  # 6 by the weights
    assert order.count("A") == order.count("B") == 8
