"""`server.max_streams` behind a real Envoy (`--response-trailers send`): two sheddable
responses hold their ext_proc streams to their ends (evictable), so with a cap of two a
third request is refused at once with 503 `picker_streams_full`, a reason and a
retry-after, counted and logged, instead of being served (here: by cutting a sheddable
response). Once the held streams end, requests are served again. The bound is what keeps a
client that opens thousands of slow streams from growing the picker's memory past ~30 KiB
per stream times the cap (bench/bench_held_streams.py)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
import yaml

from extproc import protocol
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.chat_bodies import distinct_chat
from tests.e2e.sim_speed import finish_fast
from tests.e2e.test_flow_control import metric
from tests.e2e.test_flow_eviction_cut import (
    SIM,
    picker_config,
    stream_reply,
    warm_up,
    with_trailers,
)

pytestmark = pytest.mark.e2e

CRITICAL = {"x-llm-d-inference-objective": "critical"}


async def test_past_max_streams_a_request_is_refused_with_a_reason(tmp_path: Path):
    args = picker_config(tmp_path)
    cfg = yaml.safe_load((tmp_path / "picker.yaml").read_text())
    (tmp_path / "picker.yaml").write_text(yaml.safe_dump({**cfg, "server": {"max_streams": 2}}))
    opts = StackOptions(upstreams=1, sim_args=SIM, extproc_args=args, bootstrap=with_trailers)
    with Stack(opts) as stack:
        model = stack.fleet.model
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
            await warm_up(c, model)
            d1, d2 = loop.create_future(), loop.create_future()
            first = asyncio.create_task(stream_reply(c, model, 1, d1))
            second = asyncio.create_task(stream_reply(c, model, 2, d2))
            await asyncio.wait_for(asyncio.gather(d1, d2), 10)
            crit = distinct_chat(model, 3, 5, stream=False)
            r = await c.post("/v1/chat/completions", json=crit, headers=CRITICAL)
            assert r.status_code == 503
            assert r.json()["error"]["code"] == "picker_streams_full"
            assert r.headers[protocol.DROPPED_REASON_HEADER] == "picker_streams_full"
            assert r.headers["retry-after"] == "1"
            assert metric(stack, "extproc_streams_refused_total") == 1
            assert metric(stack, "extproc_flow_cuttable_streams") == 2  # the two sheddable ones
            finish_fast(stack.fleet)
            assert await first == "complete"
            assert await second == "complete"
            await asyncio.to_thread(
                wait_until,
                lambda: metric(stack, "extproc_streams_open") == 0,
                timeout_s=5,
                what="streams closed",
            )
            r = await c.post("/v1/chat/completions", json=crit, headers=CRITICAL)
            assert r.status_code == 200
        assert "server.max_streams" in stack.logs("extproc")
