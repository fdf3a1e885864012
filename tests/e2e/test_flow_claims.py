"""A higher band's request waiting for room keeps its turn (`flow_control.
waiting_claims_room`), behind a real Envoy: `extproc serve` with per-endpoint admission, two
bands (interactive 10 with `weighted-token-fairness-policy`, batch 0), a token-mode
concurrency detector, two simulated vLLM servers.

Long batch requests stream on both servers, and a medium one beside one of them. Tenant c
(over its token share: it was served before) sends a large interactive request: no server
has room, it waits. Tenant a (under its share) sends a smaller one: no room either, it waits
too. When the medium batch request ends, its server has room for either interactive
request, not both. With the setting, c's (the older, waiting first) takes it and a's goes
once c's has ended; without it, the band's fairness picks a's, and c's waits until a's has
ended (the overtaking that set the overload bench's interactive tail, bench/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack
from tests.e2e.chat_bodies import distinct_chat, estimated_prompt_tokens
from tests.e2e.flow_configs import (
    HI,
    LO,
    inflight_ended,
    long_one,
    metric_sum,
    queued,
    reserve_stack,
)

FAIRNESS = "x-llm-d-inference-fairness-id"
# Words of 7 letters (~2 tokens each): long batch on the first server (L1) and on the
# second (L2), a medium batch request beside L2 (M2), c's and a's interactive requests.
L1, L2, M2, C, A = 1000, 600, 600, 800, 550
# The prompts are up to ~6k of the sim's tokens: outputs short, decoded slowly.
DECODE_TPS = 25
LONG = 500  # output tokens: ~20 s of streaming
MEDIUM_OUT = 75  # ~3 s: c's and a's requests are both held before M2 ends


def body(model: str, seed: int, words: int, max_tokens: int) -> dict:
    return distinct_chat(model, seed, max_tokens, words=words, stream=True)


def estimate(words: int) -> int:
    return estimated_prompt_tokens(body("m", 0, words, 1))


def cap() -> int:
    """Per server: the first has 100 tokens less free than a's request needs beside L1."""
    return estimate(L1) + estimate(A) - 100


@pytest.fixture(scope="module", params=[True, False], ids=["claims", "off"])
def stack(request, tmp_path_factory) -> Iterator[tuple[Stack, bool]]:
    tmp = tmp_path_factory.mktemp("flowclaims")
    on = request.param
    with reserve_stack(
        tmp,
        cap(),
        sim_args=("--decode-tps", str(DECODE_TPS)),
        fairness="weighted-token-fairness-policy",
        reserve_for_higher_bands=0,
        waiting_claims_room=on,
    ) as s:
        yield s, on


def test_the_sizes_make_the_case():
    k, l2, m2, c, a = cap(), estimate(L2), estimate(M2), estimate(C), estimate(A)
    free1, free2 = k - estimate(L1), k - l2 - m2
    assert c > a > free1 and a > free2  # both wait
    assert c <= k - l2 and c + a > k - l2  # M2's end makes room for either, not both
    assert m2 > free1 and m2 <= k - l2  # M2 fits beside L2 only


async def test_the_waiting_request_keeps_its_turn(stack: tuple[Stack, bool]):
    s, on = stack
    model = s.fleet.model
    loop = asyncio.get_running_loop()
    done: dict[str, float] = {}
    async with httpx.AsyncClient(base_url=s.url, timeout=60) as client:
        # c's token history: it is over its share when both wait.
        for i in range(2):
            r = await client.post("/v1/chat/completions", json=body(model, 10 + i, 100, 1),
                                  headers=HI | {FAIRNESS: "c"})  # fmt: skip
            assert r.status_code == 200
        await inflight_ended(s)

        def batch(seed: int, words: int, out: int) -> tuple[asyncio.Task[int], asyncio.Future[str]]:
            at: asyncio.Future[str] = loop.create_future()
            send = long_one(client, lambda _: body(model, seed, words, out), 0, LO, at)
            return asyncio.create_task(send), at

        long1, at1 = batch(20, L1, LONG)
        s1 = await asyncio.wait_for(at1, 30)
        long2, at2 = batch(21, L2, LONG)
        s2 = await asyncio.wait_for(at2, 30)
        medium, atm = batch(22, M2, MEDIUM_OUT)
        assert s2 != s1 and await asyncio.wait_for(atm, 30) == s2

        async def interactive(tenant: str, seed: int, words: int) -> httpx.Response:
            r = await client.post("/v1/chat/completions", json=body(model, seed, words, 1),
                                  headers=HI | {FAIRNESS: tenant})  # fmt: skip
            done[tenant] = time.monotonic()
            return r

        c = asyncio.create_task(interactive("c", 30, C))
        for _ in range(100):
            if await asyncio.to_thread(queued, s, 10) == 1:
                break
            await asyncio.sleep(0.02)
        a = asyncio.create_task(interactive("a", 31, A))
        for _ in range(100):
            if await asyncio.to_thread(queued, s, 10) == 2:
                break
            await asyncio.sleep(0.02)
        assert await asyncio.to_thread(queued, s, 10) == 2, "both interactive requests held"
        assert not medium.done(), "the medium batch request ended too soon"
        rc, ra = await asyncio.wait_for(asyncio.gather(c, a), 30)
        assert rc.status_code == 200 and ra.status_code == 200
        assert await medium == 200
        assert not long1.done() and not long2.done(), "a long request ended too soon"
        claims = metric_sum(s, r"^extproc_flow_room_claims_total (\S+)$", present=on)
        if on:
            # c's took the room M2 freed; a's went once c's had ended.
            assert rc.headers[SERVED_BY_HEADER] == s2
            assert done["c"] < done["a"]
            assert claims >= 2  # c's, then c's and a's as each waited
        else:
            assert done["a"] < done["c"]
            assert claims == 0
        long1.cancel()
        long2.cancel()
        await asyncio.gather(long1, long2, return_exceptions=True)
