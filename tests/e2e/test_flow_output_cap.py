"""A request's own max_tokens counts in per-endpoint admission, behind a real Envoy:
`extproc serve` with `admit_per_endpoint`, a token-mode concurrency detector that counts
256 output tokens per in-flight request (`outputTokens`, the configured
`expected_output_tokens`), one simulated vLLM server.

With one long request streaming on the server, a second request that asks for 4 tokens
fits under the ceiling (prompt + 4), so it is answered at once; counted with the constant
256 (the old estimate, and what a request without a lower cap still gets) it did not fit
and waited in the picker until the first ended. A request whose cap is above the
expectation is counted at the expectation (vLLM allocates KV as it generates, so a
generous cap is not KV taken): the control here, held while the first streams."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import distinct_chat, estimated_prompt_tokens
from tests.e2e.flow_configs import output_ceiling_config, queued
from tests.e2e.sim_speed import finish_fast

OUTPUT = 256  # expected output tokens, and the detector's per-request constant
LONG = 600  # output tokens at 100 tokens/s: the first request streams for ~6 s


def body(model: str, seed: int, max_tokens: int) -> dict:
    return distinct_chat(model, seed, max_tokens)


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    prompt = estimated_prompt_tokens(body("m", 1, 1))
    # One request in flight (prompt + 256) plus one asking for 4 (prompt + 4) fit; plus
    # one counted at 256 (the old estimate) do not: the ceiling halfway between.
    ceiling = 2 * prompt + OUTPUT + 4 + (OUTPUT - 4) // 2
    path = output_ceiling_config(tmp_path_factory.mktemp("flowcap"), ceiling, OUTPUT, OUTPUT)
    sim = ("--decode-tps", "100")
    with Stack(StackOptions(upstreams=1, sim_args=sim, extproc_args=("--config", str(path)))) as s:
        yield s


async def test_a_short_answer_fits_beside_a_long_one_a_generous_cap_does_not(stack: Stack):
    model = stack.fleet.model
    started: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def long_one(c: httpx.AsyncClient) -> int:
        async with c.stream("POST", "/v1/chat/completions", json=body(model, 1, LONG)) as r:
            started.set_result(None)
            async for _ in r.aiter_lines():
                pass
            return r.status_code

    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        first = asyncio.create_task(long_one(c))
        await asyncio.wait_for(started, 30)
        # Asks for 4 tokens: admitted beside the first (before: held until it ended).
        short = await c.post("/v1/chat/completions", json=body(model, 2, 4))
        assert short.status_code == 200
        assert not first.done(), "the long request ended before the check"
        # Asks for 400: counted at the expected 256, so it does not fit beside the first.
        generous = asyncio.create_task(c.post("/v1/chat/completions", json=body(model, 3, 400)))
        for _ in range(200):
            if generous.done() or await asyncio.to_thread(queued, stack) == 1:
                break
            await asyncio.sleep(0.1)
        assert not generous.done(), "a request counted at 256 was placed beside the first"
        assert not first.done(), "the long request ended before the check"
        # Checked: the first one ends now, not ~4 s of decoding later; the generous one
        # is released then and runs as fast.
        finish_fast(stack.fleet)
        assert await first == 200
        assert (await generous).status_code == 200  # released once the first ended
        assert queued(stack) == 0
