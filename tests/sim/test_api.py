"""The OpenAI surface of a simulated server, over real HTTP."""

from __future__ import annotations

import asyncio
import base64
import json
import time
from pathlib import Path

import aiohttp

from extproc.sim import TIMING_HEADER
from extproc.sim.server import SERVED_BY_HEADER
from extproc.sim.timing import TimingSettings
from tests.requests.images import png
from tests.sim.conftest import StartSim

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu"
PROMPT = "The router sends the prefix to the server today. The cache stores many blocks."


async def test_completion_answers_vllm_shape_with_real_token_counts(start_sim: StartSim):
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 5}
        async with http.post(f"{srv.url}/v1/completions", json=body) as resp:
            assert resp.status == 200
            assert resp.headers[SERVED_BY_HEADER] == srv.name
            out = await resp.json()
    assert out["object"] == "text_completion"
    assert out["id"].startswith("cmpl-")
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == 5
    assert out["usage"]["prompt_tokens"] == out["usage"]["total_tokens"] - 5


async def test_completion_tokens_match_captured_vllm_prompt_ids(start_sim: StartSim):
    lines = (FIXTURES / "A-sha256-int-bs32" / "requests.jsonl").read_text().splitlines()
    captured = json.loads(lines[0])
    async with (
        start_sim(events=False) as srv,
        aiohttp.ClientSession() as http,
        http.post(f"{srv.url}/tokenize", json=captured["request"]) as resp,
    ):
        out = await resp.json()
    assert out["tokens"] == captured["prompt_token_ids"]


async def test_chat_stream_is_valid_sse_with_usage_last(start_sim: StartSim):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 4,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    async with (
        start_sim(events=False) as srv,
        aiohttp.ClientSession() as http,
        http.post(f"{srv.url}/v1/chat/completions", json=body) as resp,
    ):
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        raw = (await resp.read()).decode()
    events = raw.split("\n\n")
    assert events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
    assert events[-2] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-2]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    content = [c for c in chunks if c["choices"] and "content" in c["choices"][0]["delta"]][1:]
    assert len(content) == 4
    assert content[-1]["choices"][0]["finish_reason"] == "length"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 4


async def test_timing_header_adds_the_first_tokens_breakdown_as_an_sse_comment(
    start_sim: StartSim,
):
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hello there"}],
        "max_tokens": 3,
        "stream": True,
    }
    async with (
        start_sim(events=False) as srv,
        aiohttp.ClientSession() as http,
        http.post(
            f"{srv.url}/v1/chat/completions", json=body, headers={TIMING_HEADER: "1"}
        ) as resp,
    ):
        raw = (await resp.read()).decode()
    comments = [e for e in raw.split("\n\n") if e.startswith(":")]
    assert len(comments) == 1
    parts = dict(kv.split("=") for kv in comments[0].removeprefix(": timing ").split())
    assert set(parts) == {
        "kv_wait_s", "lane_wait_s", "prefill_s", "recv_at",
        # The engine's KV on arrival, in blocks (engine.ArrivalKV).
        "free_blocks", "need_blocks", "held_blocks", "ahead", "ahead_blocks",
    }  # fmt: skip
    assert all(float(v) >= 0 for v in parts.values()) and float(parts["prefill_s"]) > 0
    assert int(parts["need_blocks"]) >= 1 and int(parts["ahead"]) == 0
    # The arrival, on the wall clock: a bench on the same host subtracts its send time.
    assert abs(float(parts["recv_at"]) - time.time()) < 60


async def test_completion_stream_without_usage_ends_with_done(start_sim: StartSim):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 3, "stream": True}
    async with (
        start_sim(events=False) as srv,
        aiohttp.ClientSession() as http,
        http.post(f"{srv.url}/v1/completions", json=body) as resp,
    ):
        raw = (await resp.read()).decode()
    events = [e for e in raw.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert len(chunks) == 3 and all("usage" not in c for c in chunks)


async def test_bad_body_gets_vllm_400_json(start_sim: StartSim):
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        async with http.post(f"{srv.url}/v1/chat/completions", data=b"{not json") as resp:
            assert resp.status == 400
            err = (await resp.json())["error"]
        async with http.post(f"{srv.url}/v1/completions", json={"model": "x", "prompt": "a"}) as r2:
            assert r2.status == 404
    assert err["type"] == "BadRequestError" and err["code"] == 400


async def test_too_long_request_gets_400(start_sim: StartSim):
    async with start_sim(events=False, max_model_len=64) as srv, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": PROMPT * 4, "max_tokens": 10}
        async with http.post(f"{srv.url}/v1/completions", json=body) as resp:
            assert resp.status == 400
            assert "maximum context length" in (await resp.json())["error"]["message"]


async def test_models_and_health(start_sim: StartSim):
    async with start_sim(events=False, model="m1") as srv, aiohttp.ClientSession() as http:
        async with http.get(f"{srv.url}/v1/models") as resp:
            models = await resp.json()
        async with http.get(f"{srv.url}/health") as resp:
            assert resp.status == 200
    assert [m["id"] for m in models["data"]] == ["m1"]


async def test_image_expands_to_placeholder_tokens_and_fills_encoder_cache(start_sim: StartSim):
    uri = "data:image/png;base64," + base64.b64encode(png(224, 224)).decode()
    content = [
        {"type": "text", "text": "What is in this picture?"},
        {"type": "image_url", "image_url": {"url": uri}},
    ]
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}], "max_tokens": 2}
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        async with http.post(f"{srv.url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            usage = (await resp.json())["usage"]
        async with http.get(f"{srv.url}/sim/cache") as resp:
            cache = await resp.json()
    assert usage["prompt_tokens"] > 64  # 224x224 at 784 px/token = 64 placeholders + text
    assert len(cache["encoder"]) == 1
    with_media = [b for b in cache["blocks"] if b["extra_keys"]]
    assert with_media and with_media[0]["extra_keys"][0] == cache["encoder"][0]


async def test_client_hanging_up_mid_stream_frees_its_blocks(start_sim: StartSim):
    body = {"model": "tiny", "prompt": PROMPT * 3, "max_tokens": 1000, "stream": True}
    async with start_sim(events=False) as srv:
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"{srv.url}/v1/completions", json=body) as resp,
        ):
            await resp.content.readline()
            assert srv.engine.gauges().running == 1
        for _ in range(100):
            if srv.engine.gauges().running == 0:
                break
            await asyncio.sleep(0.01)
        assert srv.engine.gauges().running == 0
        assert srv.engine.cache.usage == 0.0
        # As vLLM 0.32: a cut request is not counted as finished, for any reason.
        assert sum(srv.engine.stats.finished.values()) == 0


async def test_client_hanging_up_before_its_first_token_frees_its_blocks_at_once(
    start_sim: StartSim,
):
    # B waits for the prefill lane behind A's step (0.3 s) and its client hangs up: vLLM
    # aborts it at once (it never prefills); the sim used to notice only at B's first
    # token's write, after running B's whole prefill with its KV held.
    slow = TimingSettings(prefill_tps=2000.0)
    body = {"model": "tiny", "prompt": PROMPT * 40, "max_tokens": 5, "stream": True}
    async with (
        start_sim(events=False, timing=slow) as srv,
        aiohttp.ClientSession() as http,
        http.post(f"{srv.url}/v1/completions", json=body) as a,
    ):
        other = {**body, "prompt": "Another tenant asks. " + body["prompt"]}  # no prefix hit
        async with http.post(f"{srv.url}/v1/completions", json=other):
            for _ in range(100):
                if len(srv.engine.prefill_order()) == 2:
                    break
                await asyncio.sleep(0.002)
            assert len(srv.engine.prefill_order()) == 2
            held_both = srv.engine.cache.usage
        start = time.monotonic()
        while len(srv.engine.prefill_order()) == 2 and time.monotonic() - start < 1.0:
            await asyncio.sleep(0.005)
        waited = time.monotonic() - start
        assert waited < 0.1  # A's step (0.3 s) still under way: B never reached its prefill
        assert len(srv.engine.prefill_order()) == 1
        assert srv.engine.cache.usage < held_both
        await a.content.readline()  # A is served as before
