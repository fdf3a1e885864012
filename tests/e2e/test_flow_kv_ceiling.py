"""Flow control sized by the engine's own KV, behind a real Envoy: `extproc serve` with the
concurrency detector in `tokens` mode, `kvCacheFraction` (the token ceiling read from the
simulated vLLM's `vllm:cache_config_info`, no hand-set `maxTokenConcurrency`) and
`outputTokens` (each in-flight request's output counts besides its prompt, as the engine
holds KV for both). Until the KV size is scraped the endpoint counts as saturated and the
picker says so in a metric; then exactly as many requests start as the KV holds by that
count, the rest wait in the picker and are served as the first ones end. With
`count_engine_blocks` the picker says it counts prompts at its prior ratio (1 /
kvCacheFraction) until calibration measures."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.requests import parse_request
from extproc.requests.settings import ParseSettings
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.sim_speed import finish_fast

BLOCKS, BLOCK = 64, 16  # the sim's KV: 1,024 tokens
OUTPUT = 300
PROMPT = "tell me about the weather in the mountains " * 8
CONFIG = {
    "parse": {"bytes_per_token": 4, "calibrate": False},  # a fixed estimate to reckon with
    "state": {"request_end": {"mode": "access-log"}},  # in flight until the stream ends
    # Released work counts its output as placed work does (outputTokens).
    "flow_control": {"expected_output_tokens": OUTPUT, "admit_per_endpoint": True},
    "scheduling": {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {
                "type": "concurrency-detector",
                "parameters": {
                    "concurrencyMode": "tokens",
                    "kvCacheFraction": 1.0,
                    "outputTokens": OUTPUT,
                },
            },
        ],
        "flowControl": {
            "defaultRequestTTL": "60s",
            "saturationDetector": {"pluginRef": "concurrency-detector"},
        },
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    },
}


@pytest.fixture(scope="module")
def kv_stack(tmp_path_factory) -> Iterator[Stack]:
    cfg = tmp_path_factory.mktemp("flowkv") / "picker.yaml"
    cfg.write_text(yaml.safe_dump(CONFIG))
    # 300 output tokens at 100 tokens/s: each request holds its KV for ~3 s.
    sim = ("--num-gpu-blocks", str(BLOCKS), "--block-size", str(BLOCK), "--decode-tps", "100")
    with Stack(StackOptions(upstreams=1, sim_args=sim, extproc_args=("--config", str(cfg)))) as s:
        yield s


def metric(stack: Stack, name: str) -> float | None:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    found = [float(m) for m in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)]
    return sum(found) if found else None


def body(model: str, i: int = 0) -> dict:
    # Distinct from the first block on (no prefix hit: every request's whole prompt counts),
    # all of one length (one estimate).
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"{i:03d} {PROMPT}"}],
        "max_tokens": OUTPUT,
        "stream": True,
    }


async def test_admits_what_the_engines_kv_holds_and_queues_the_rest(kv_stack: Stack):
    stack = kv_stack
    # The KV size arrives with the first scrape; until then the endpoint counts as full.
    wait_until(
        lambda: metric(stack, "extproc_flow_detector_unknown_capacity_endpoints") == 0,
        timeout_s=20,
        what="the engine's KV size scraped",
    )
    est = parse_request(
        "/v1/chat/completions",
        {},
        json.dumps(body(stack.fleet.model)).encode(),
        ParseSettings(bytes_per_token=4),
    ).prompt_tokens
    cost = est + OUTPUT
    kv = BLOCKS * BLOCK
    # A request starts where the server stays within its ceiling with it (per-endpoint
    # admission; by the pool alone one more started, to wait in the engine).
    starts = kv // cost
    n = starts + 3
    assert starts >= 2 and (est * n) / kv < 1, "without outputTokens nothing would queue"

    async def one(c: httpx.AsyncClient, i: int) -> int:
        async with c.stream("POST", "/v1/chat/completions", json=body(stack.fleet.model, i)) as r:
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        tasks = [asyncio.create_task(one(c, i)) for i in range(n)]
        # While the first ones stream (~3 s each), the rest wait in the picker.
        queued: list[float] = []
        for _ in range(100):
            q = metric(stack, "extproc_flow_queue_requests") or 0.0
            queued.append(q)
            if q == n - starts:
                break
            await asyncio.sleep(0.05)
        assert max(queued) == n - starts, queued
        # Checked: the running ones end now, and each released one runs as fast, instead
        # of ~3 s each in turn.
        finish_fast(stack.fleet)
        statuses = await asyncio.gather(*tasks)
    assert statuses == [200] * n
    assert metric(stack, "extproc_flow_queue_requests") in (0.0, None)


def test_counts_engine_blocks_once_calibration_measures_and_says_so_until_then(tmp_path):
    """`count_engine_blocks` in the assembled server: once the block size is scraped the
    first requests are counted at the prior ratio and the picker says so (the prior
    counter; none by their tokens), until calibration's ratio reaches flow control (the
    ratio gauge)."""
    cfg = json.loads(json.dumps(CONFIG))
    cfg["parse"] = {"bytes_per_token": 4}  # calibrated: the ratio the blocks are counted by
    cfg["flow_control"]["count_engine_blocks"] = True
    path = tmp_path / "picker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    opts = StackOptions(upstreams=1, sim_args=(), extproc_args=("--config", str(path)))
    with Stack(opts) as stack, httpx.Client(base_url=stack.url, timeout=30) as c:
        wait_until(
            lambda: metric(stack, "extproc_flow_detector_unknown_capacity_endpoints") == 0,
            timeout_s=20,
            what="the engine's KV size scraped",
        )

        def send(i: int) -> None:
            # Long, distinct prompts: calibration's window wants 16k engine tokens.
            text = f"{i:04d} " + "the quick brown fox jumps over a lazy dog, " * 80
            r = c.post(
                "/v1/chat/completions",
                json={
                    "model": stack.fleet.model,
                    "messages": [{"role": "user", "content": text}],
                    "max_tokens": 1,
                },
            )
            assert r.status_code == 200

        send(0)
        assert (metric(stack, "extproc_flow_engine_blocks_prior_total") or 0) >= 1
        assert metric(stack, "extproc_flow_engine_blocks_unmeasured_total") == 0
        assert metric(stack, "extproc_flow_engine_blocks_ratio") == 0
        i = 1

        def measured() -> bool:
            nonlocal i
            send(i)
            i += 1
            return (metric(stack, "extproc_flow_engine_blocks_ratio") or 0) > 0

        wait_until(measured, timeout_s=20, what="calibration's ratio reaching flow control")
        # Counted at the measured ratio from then on: no more at the prior.
        before = metric(stack, "extproc_flow_engine_blocks_prior_total")
        send(i)
        assert metric(stack, "extproc_flow_engine_blocks_prior_total") == before
