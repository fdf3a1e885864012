"""The prefill gate's `steerKvMargin` behind a real Envoy: `extproc serve` with the prefill-gate
tests' config (two bands, per-endpoint admission, the token ceiling `CAP` per server, prompts
counted alone) and two simulated servers with a slow prefill.

A long batch request takes one server (X) to within 2% of its ceiling and is decoding there;
a shorter one prefills on the other (Y). An interactive request then fits both: steering by
unfinished prefill alone sends it to X, at 0.985 of its ceiling; with a margin of 0.03 it
goes to Y, and the gate counts the steer. Why: in the overload bench the server with the least
unfinished prefill was often the fullest, and the picker's count runs 1-4% under what an
engine holds there, so interactive requests steered to it waited for KV while the other
server had room (bench/RESULTS.md, issue 15, twenty-eighth session)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import distinct_chat, estimated_prompt_tokens
from tests.e2e.flow_configs import metric_sum, prefill_gate_config

HI = {"x-llm-d-inference-objective": "interactive"}
LO = {"x-llm-d-inference-objective": "batch"}
# Words: X's long prompt (prefills ~1 s at PREFILL_TPS), Y's (~0.5 s), the interactive one's.
LONG, MID, TINY = 250, 120, 10
PREFILL_TPS = 2000
MARGIN = 0.03


def body(model: str, seed: int, words: int, max_tokens: int) -> dict:
    return distinct_chat(model, seed, max_tokens, words=words)


def estimate(words: int) -> int:
    return estimated_prompt_tokens(body("m", 0, words, 1))


# X with the interactive request on it at 0.985 of its ceiling: within the margin.
CAP = round((estimate(LONG) + estimate(TINY)) / 0.985)


@contextlib.contextmanager
def edge_stack(tmp, margin: float) -> Iterator[Stack]:
    gate = {"maxPrefillTokens": 100_000, "steerKvMargin": margin}
    path = prefill_gate_config(tmp, gate, cap=CAP)
    sim = ("--prefill-tps", str(PREFILL_TPS), "--decode-tps", "100")
    with Stack(StackOptions(upstreams=2, sim_args=sim, extproc_args=("--config", str(path)))) as s:
        yield s


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with edge_stack(tmp_path_factory.mktemp("flowgateedge"), MARGIN) as s:
        yield s


def generated(line: str) -> bool:
    """A streamed chunk with generated text (the first chunk carries only the role)."""
    if not line.startswith("data:") or line == "data: [DONE]":
        return False
    chunk = json.loads(line[5:])
    return any((c.get("delta") or {}).get("content") for c in chunk.get("choices") or ())


async def batch(
    c: httpx.AsyncClient, req: dict, at: asyncio.Future[str], decoding: asyncio.Future[None]
) -> None:
    """Streams `req` as batch: `at` gets its server at the headers, `decoding` is set at its
    first generated token; then read to the end."""
    async with c.stream("POST", "/v1/chat/completions", json=req, headers=LO) as r:
        assert r.status_code == 200
        at.set_result(r.headers[SERVED_BY_HEADER])
        async for line in r.aiter_lines():
            if generated(line) and not decoding.done():
                decoding.set_result(None)


async def interactive_server(stack: Stack) -> tuple[str, str, str]:
    """(X, Y, the interactive request's server) for the scenario in the module docstring."""
    model = stack.fleet.model
    loop = asyncio.get_running_loop()
    futs = [(loop.create_future(), loop.create_future()) for _ in range(2)]
    async with httpx.AsyncClient(base_url=stack.url, timeout=60) as c:
        # X: the long one, decoding for ~3 s once prefilled.
        x_task = asyncio.create_task(batch(c, body(model, 1, LONG, 300), *futs[0]))
        await asyncio.wait_for(futs[0][1], 30)
        await asyncio.sleep(0.3)  # a few scrapes show its prefill done
        # Y: a shorter one, only X's room being short for it; in prefill while we decide.
        y_task = asyncio.create_task(batch(c, body(model, 2, MID, 300), *futs[1]))
        await asyncio.wait_for(futs[1][0], 30)
        r = await c.post("/v1/chat/completions", json=body(model, 3, TINY, 1), headers=HI)
        assert r.status_code == 200
        x, y = futs[0][0].result(), futs[1][0].result()
        for t in (x_task, y_task):
            t.cancel()
        await asyncio.gather(x_task, y_task, return_exceptions=True)
    return x, y, r.headers[SERVED_BY_HEADER]


async def test_interactive_is_steered_off_the_server_at_its_kv_edge(stack: Stack):
    x, y, hi = await interactive_server(stack)
    assert x != y, "the second batch request should not fit beside the first"
    assert hi == y, "steered to the server at its KV edge"
    steered = metric_sum(stack, r"^extproc_flow_prefill_gate_steered_off_edge_total (\S+)$")
    assert steered == 1
