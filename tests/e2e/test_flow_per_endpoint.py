"""Per-endpoint admission behind a real Envoy: `extproc serve` with flow control (one slot
per server, concurrency-detector) and cache affinity as the only scorer, in front of two
simulated vLLM servers. While one server streams a long answer, a request sharing its
prompt's prefix arrives: by the pool's average (one of two slots used) it would be admitted
and placed on the busy server (its prefix is there), to wait in that engine's queue.
Admitted per endpoint, it is released only where a server has room, and placed there: the
idle server answers it while the first still streams. With both servers busy, the next one
waits in the picker (not in an engine) and says so in
`extproc_flow_no_endpoint_room_total` when the pool's average alone would have let it go."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions

CONFIG = {
    "parse": {"block_tokens": 16, "bytes_per_token": 4, "calibrate": False},
    "state": {"request_end": {"mode": "access-log"}},  # in flight until the stream ends
    "scheduling": {
        "plugins": [
            {"type": "prefix-cache-scorer"},
            {"type": "max-score-picker"},
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": 1}},
        ],
        "flowControl": {
            "defaultRequestTTL": "60s",
            "saturationDetector": {"pluginRef": "concurrency-detector"},
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "prefix-cache-scorer"},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    },
    "flow_control": {"admit_per_endpoint": True},
}
PREFIX = "the long shared system prompt about mountains and weather and rivers " * 12
LONG = 400  # output tokens at 100 tokens/s: the first request streams for ~4 s


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    cfg = tmp_path_factory.mktemp("flowep") / "picker.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    sim = ("--decode-tps", "100")
    with Stack(StackOptions(upstreams=2, sim_args=sim, extproc_args=("--config", str(cfg)))) as s:
        yield s


def metric(stack: Stack, name: str) -> float:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    return sum(float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def body(model: str, tail: str, max_tokens: int) -> dict:
    return {
        "model": model,
        "messages": [{"role": "user", "content": PREFIX + tail}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def test_placed_where_a_server_has_room_not_behind_its_prefix(stack: Stack):
    model = stack.fleet.model
    first_by: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    async def long_one(c: httpx.AsyncClient) -> int:
        async with c.stream("POST", "/v1/chat/completions", json=body(model, "one", LONG)) as r:
            first_by.set_result(r.headers[SERVED_BY_HEADER])
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        first = asyncio.create_task(long_one(c))
        busy = await asyncio.wait_for(first_by, 30)
        # Same prefix, while the first still streams (its slot is held to the stream's end).
        r = await c.post("/v1/chat/completions", json=body(model, "two", 4))
        assert r.status_code == 200
        assert not first.done(), "the first request ended before the second was placed"
        assert r.headers[SERVED_BY_HEADER] != busy  # by the pool's average: on `busy`
        assert await first == 200
