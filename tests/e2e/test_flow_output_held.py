"""A request's own max_tokens counts for as long as it runs, behind a real Envoy:
`extproc serve` with `admit_per_endpoint`, a token-mode concurrency detector counting a
small constant output per in-flight request (`outputTokens` 16) and
`expected_output_tokens` 600, one simulated vLLM server (which, as the overload bench's
fleet, holds KV for prompt + max_tokens).

The ext_proc stream of a streamed request ends at its response headers, before its
prefill; its in-flight count is held until Envoy's access log says it ended. Its own 600
output tokens used to stop counting at the stream's end (the constant 16 stood in), so a
second request of 600 was released beside a running first one although both did not fit;
now it waits in the picker until the first ends."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import distinct_chat, estimated_prompt_tokens
from tests.e2e.flow_configs import output_ceiling_config, queued
from tests.e2e.sim_speed import finish_fast

BASE = 16  # the detector's output per in-flight request
OUTPUT = 600  # each request's max_tokens (and expected_output_tokens): ~6 s at 100 tokens/s


def body(model: str, seed: int) -> dict:
    return distinct_chat(model, seed, OUTPUT)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    prompt = estimated_prompt_tokens(body("m", 1))
    # Two requests counted with their own output do not fit; one of them with the
    # constant in place of its output does (the ceiling halfway between).
    ceiling = 2 * prompt + OUTPUT + BASE + (OUTPUT - BASE) // 2
    path = output_ceiling_config(tmp_path_factory.mktemp("flowheld"), ceiling, BASE, OUTPUT)
    sim = ("--decode-tps", "100")
    with Stack(StackOptions(upstreams=1, sim_args=sim, extproc_args=("--config", str(path)))) as s:
        yield s


async def test_a_running_requests_own_output_counts_past_its_stream(stack: Stack):
    model = stack.fleet.model
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def long_one(c: httpx.AsyncClient) -> int:
        async with c.stream("POST", "/v1/chat/completions", json=body(model, 1)) as r:
            started.set_result(None)  # response headers: the ext_proc stream has ended
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        first = asyncio.create_task(long_one(c))
        await asyncio.wait_for(started, 30)
        await asyncio.sleep(0.5)  # well past the stream's end
        second = asyncio.create_task(c.post("/v1/chat/completions", json=body(model, 2)))
        held = False
        for _ in range(30):
            held = await asyncio.to_thread(queued, stack) == 1
            if held or second.done():
                break
            await asyncio.sleep(0.1)
        assert held and not second.done(), "placed beside the first: its output counted as 16"
        assert not first.done(), "the first request ended before the check"
        # The first one ends now (not ~5 s of decoding later), the second then runs fast.
        finish_fast(stack.fleet)
        assert await first == 200
        assert (await second).status_code == 200  # released once the first ended
        assert queued(stack) == 0
