"""What a client's abort does to the engine's counters: real vLLM and the simulator agree.

One trace on a one-slot engine (`--max-num-seqs 1`), read from `/metrics` after each step:

- `waiting`: a long request decodes to its end; a second one, queued behind it, is cut
  before its first token;
- `decoding`: another long request is cut mid-decode;
- `completed`: a short request runs to its end.

vLLM 0.32 counts neither cut in `request_success_total` (any reason) nor in the histograms it
observes at a request's finish; the one cut after its first token stays in
`time_to_first_token_seconds`. The picker's count of requests before their first token
(extproc/endpoints/state.py) rests on exactly these counters, so the simulator must count
the same; the figures are printed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator

import httpx
import pytest

from extproc.sim.engine import EngineSettings
from extproc.sim.server import ServerSettings, SimServer
from extproc.sim.timing import TimingSettings
from tests.vllm.fleet import MODEL_NAME, VllmServer, one_server

MAX_LEN = 2048
LONG_TOKENS = 1800  # decodes for seconds on either engine: cut long before its end
# Counters whose change over each step is compared (histograms by their count).
WATCHED = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    'vllm:request_success_total{finished_reason="stop"}',
    'vllm:request_success_total{finished_reason="length"}',
    'vllm:request_success_total{finished_reason="abort"}',
    "vllm:time_to_first_token_seconds_count",
    "vllm:e2e_request_latency_seconds_count",
    "vllm:request_queue_time_seconds_count",
    "vllm:request_prefill_time_seconds_count",
    "vllm:request_decode_time_seconds_count",
    "vllm:request_prompt_tokens_count",
    "vllm:request_generation_tokens_count",
)
SETTLE_S = 0.5  # the engine's stats follow its outputs
# A cut this long after the long request's first token reached the client: inside its
# decode (~2 s of stream on vLLM here, ~2 s on the simulator).
CUT_AFTER_S = 0.1
ATTEMPTS = 4


def ids(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 460) for _ in range(n)]


def counters(text: str) -> dict[str, float]:
    """The watched figures, labels other than `finished_reason` (model, engine) dropped."""
    out = dict.fromkeys(WATCHED, 0.0)
    for line in text.splitlines():
        if not line.startswith("vllm:"):
            continue
        series, _, value = line.rpartition(" ")
        name, _, labels = series.partition("{")
        key = name
        for label in labels.rstrip("}").split(","):
            if label.startswith("finished_reason="):
                key = f"{name}{{{label}}}"
        if key in out:
            out[key] += float(value)
    return out


async def abort_trace(url: str) -> dict[str, dict[str, float]]:
    """Each step's change in the watched counters (the gauges: their value after it)."""
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:

        async def scrape() -> dict[str, float]:
            await asyncio.sleep(SETTLE_S)
            return counters((await http.get("/metrics")).text)

        async def stream(prompt: list[int], max_tokens: int, first: asyncio.Event) -> None:
            body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": max_tokens,
                    "stream": True, "ignore_eos": True}  # fmt: skip
            async with http.stream("POST", "/v1/completions", json=body) as r:
                assert r.status_code == 200, await r.aread()
                async for line in r.aiter_lines():
                    if line.startswith("data:") and line != "data: [DONE]":
                        first.set()

        steps: dict[str, dict[str, float]] = {}
        before = await scrape()

        def delta(now: dict[str, float]) -> dict[str, float]:
            return {k: now[k] if "num_requests" in k else now[k] - before[k] for k in WATCHED}

        async def waiting(seed: int) -> dict[str, float]:
            # A long request runs to its end; one queued behind it is cut.
            first, queued_first = asyncio.Event(), asyncio.Event()
            long = asyncio.create_task(stream(ids(40, seed), LONG_TOKENS, first))
            await asyncio.wait_for(first.wait(), 60)
            queued = asyncio.create_task(stream(ids(40, seed + 1), 8, queued_first))
            await asyncio.sleep(CUT_AFTER_S)
            queued.cancel()
            await long
            return delta(await scrape())

        async def decoding(seed: int) -> dict[str, float]:
            # A long request cut mid-decode.
            first = asyncio.Event()
            long = asyncio.create_task(stream(ids(40, seed), LONG_TOKENS, first))
            await asyncio.wait_for(first.wait(), 60)
            await asyncio.sleep(CUT_AFTER_S)
            long.cancel()
            return delta(await scrape())

        # vLLM's engine may run ahead of the stream the client reads (it decoded the long
        # request to its end before the cut once): a step whose engine finished more than
        # the requests meant to finish (1 and 0), or gave more than the long request's
        # first token, did not test its cut, and runs again. A cut request is never counted
        # as `length`, nor one cut before its first token as a first token, so a retry
        # never hides the answer.
        for name, run, finished in (("waiting", waiting, 1), ("decoding", decoding, 0)):
            for attempt in range(ATTEMPTS):
                d = await run(10 * attempt + 1)
                before = {k: before[k] + d[k] for k in WATCHED}
                if d[WATCHED[3]] == finished and d[WATCHED[5]] == 1:
                    steps[name] = d
                    break
            else:
                pytest.fail(f"{name}: the engine finished the request before every cut")
        await stream(ids(40, 4), 4, asyncio.Event())
        steps["completed"] = delta(await scrape())
        return steps


@pytest.fixture(scope="module")
def engine() -> Iterator[VllmServer]:
    flags = ("--max-num-seqs", "1", "--max-model-len", str(MAX_LEN))
    with one_server("extproc-vllm-aborts-", *flags) as srv:
        yield srv


async def sim_trace() -> dict[str, dict[str, float]]:
    # Slow decode (the long request must still run at its cut); the slot as vLLM's.
    engine = EngineSettings(
        model=MODEL_NAME,
        max_num_seqs=1,
        max_model_len=MAX_LEN,
        block_size=32,
        timing=TimingSettings(decode_tps=1000.0),
    )
    async with SimServer(ServerSettings(engine=engine)) as server:
        return await abort_trace(server.url)


def test_the_simulator_counts_aborts_as_vllm_does(engine: VllmServer, capsys):
    real = asyncio.run(abort_trace(engine.url))
    sim = asyncio.run(sim_trace())
    with capsys.disabled():
        for name in real:
            print(f"\n{name}:")
            for k in WATCHED:
                print(f"  {k}: vLLM {real[name][k]:g}, simulator {sim[name][k]:g}")
    # The oracle, as read from vLLM 0.32's code (OutputProcessor.abort_requests drops the
    # request's state without stats): a cut request is never finished in the counters, nor
    # observed at its end; one cut after its first token keeps its first-token count.
    finished = [WATCHED[3], WATCHED[4]]  # finished as length, as abort
    assert [real["waiting"][k] for k in finished] == [1, 0], real  # the long one's end only
    assert real["waiting"]["vllm:e2e_request_latency_seconds_count"] == 1, real
    assert [real["decoding"][k] for k in finished] == [0, 0], real
    assert real["decoding"]["vllm:e2e_request_latency_seconds_count"] == 0, real
    assert real["decoding"]["vllm:time_to_first_token_seconds_count"] == 1, real
    assert real["completed"][finished[0]] == 1, real
    assert sim == real
