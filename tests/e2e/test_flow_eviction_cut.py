"""Eviction of a response already under way, behind a real Envoy: `extproc serve` with
`enableEviction` and a concurrency detector of two slots, one simulated vLLM server that
sends a streamed reply's headers at once and then decodes slowly.

With `extproc envoy-config --response-trailers send` the ext_proc stream lasts to the
response's end, so a critical request that finds both slots taken by sheddable requests
cuts the newest one mid-response: Envoy resets it (the client's SSE ends truncated), the
engine aborts it and frees its slot, the critical request is served, the older sheddable
request streams on. With the default config (`skip`) the stream ends at the response
headers, before the engine schedules the request: the request cannot be cut any more, and
the picker says so (`extproc_flow_eviction_uncuttable_total`, a warning)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.stack import Stack, StackOptions, free_port, wait_until
from tests.e2e.calibration_workload import gauge
from tests.e2e.chat_bodies import distinct_chat, estimated_prompt_tokens
from tests.e2e.sim_speed import finish_fast
from tests.e2e.test_flow_control import metric
from tests.e2e.test_flow_eviction import CONFIG, OBJECTIVES

SIM = ("--decode-tps", "20")  # 200 tokens: ~10 s of decoding, far beyond the cut
OUTPUT = 200
UNCUTTABLE = "extproc_flow_eviction_uncuttable_total"


def picker_config(tmp: Path) -> tuple[str, ...]:
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    flow = {**CONFIG["flow_control"], "objectives_file": str(tmp / "objectives.yaml")}
    (tmp / "picker.yaml").write_text(yaml.safe_dump({**CONFIG, "flow_control": flow}))
    return ("--config", str(tmp / "picker.yaml"))


def with_trailers(opts: BootstrapOptions) -> dict:
    return build_bootstrap(replace(opts, response_trailers="send"))


@pytest.fixture(scope="module")
def cut_stack(tmp_path_factory) -> Iterator[Stack]:
    args = picker_config(tmp_path_factory.mktemp("cut"))
    opts = StackOptions(upstreams=1, sim_args=SIM, extproc_args=args, bootstrap=with_trailers)
    with Stack(opts) as s:
        yield s


def sim_figure(stack: Stack, name: str) -> float:
    text = httpx.get(f"{stack.fleet.servers[0].url}/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^vllm:{name}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def finished(stack: Stack) -> float:
    """Requests the engine finished, every reason: as vLLM, a cut (aborted) request is not
    among them."""
    return sim_figure(stack, "request_success_total")


async def stream_reply(
    c: httpx.AsyncClient,
    model: str,
    seed: int,
    decoding: asyncio.Future,
    output: int = OUTPUT,
    objective: str = "sheddable",
) -> str:
    """Streams one reply under `objective`; `decoding` is set once tokens arrive. How it
    ended."""
    return await stream_body(c, distinct_chat(model, seed, output), decoding, objective)


async def stream_body(
    c: httpx.AsyncClient, body: dict, decoding: asyncio.Future, objective: str = "sheddable"
) -> str:
    """Streams `body` under `objective`; `decoding` is set once tokens arrive. How it
    ended."""
    tokens = 0
    headers = {"x-llm-d-inference-objective": objective}
    try:
        async with c.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data:"):
                    tokens += 1
                    if tokens == 2 and not decoding.done():
                        decoding.set_result(None)
                    if line == "data: [DONE]":
                        return "complete"
    except (httpx.RemoteProtocolError, httpx.ReadError):
        return "truncated"
    return "ended without [DONE]"


async def warm_up(c: httpx.AsyncClient, model: str) -> None:
    """One request first: its access-log entry opens the log stream, from when in-flight
    counts last to each request's end (the detector sees the sheddable ones running)."""
    r = await c.post("/v1/chat/completions", json=distinct_chat(model, 99, 1, stream=False))
    assert r.status_code == 200
    await asyncio.sleep(0.2)


async def both_decoding(
    c: httpx.AsyncClient, first: dict, second: dict
) -> tuple[asyncio.Task[str], asyncio.Task[str]]:
    """After a warm-up, streams `first` as a sheddable request and, once it decodes,
    `second`: both decoding when this returns (the streams' tasks say how each ended)."""
    await warm_up(c, first["model"])
    loop = asyncio.get_running_loop()
    d1, d2 = loop.create_future(), loop.create_future()
    one = asyncio.create_task(stream_body(c, first, d1))
    await asyncio.wait_for(d1, 10)
    two = asyncio.create_task(stream_body(c, second, d2))
    await asyncio.wait_for(d2, 10)
    return one, two


async def test_a_critical_request_cuts_a_sheddable_response_under_way(cut_stack: Stack):
    await cuts_the_newest_sheddable_response(cut_stack)


async def cuts_the_newest_sheddable_response(stack: Stack) -> None:
    """The scenario (also under the gateways' settings, tests/gateways)."""
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        first, second = await both_decoding(
            c, distinct_chat(model, 1, OUTPUT), distinct_chat(model, 2, OUTPUT)
        )
        assert sim_figure(stack, "num_requests_running") == 2  # both decoding
        crit = distinct_chat(model, 3, 5, stream=False)
        critical = asyncio.create_task(
            c.post("/v1/chat/completions", json=crit,
                   headers={"x-llm-d-inference-objective": "critical"})
        )  # fmt: skip
        # The critical request is served at once, not after a sheddable one ends.
        assert (await asyncio.wait_for(critical, 8)).status_code == 200
        # The newest sheddable response was cut mid-stream: the client sees it truncated.
        assert await asyncio.wait_for(second, 5) == "truncated"
        # The engine aborted the cut request and freed its slot; the older one runs on.
        await asyncio.to_thread(
            wait_until,
            lambda: sim_figure(stack, "num_requests_running") == 1,
            timeout_s=5,
            what="abort",
        )
        assert not first.done()
        finish_fast(stack.fleet)
        assert await first == "complete"
    assert metric(stack, "extproc_flow_requests_total", outcome="evicted_inflight") == 1
    assert metric(stack, UNCUTTABLE) == 0


async def test_the_default_config_cannot_cut_and_says_so(tmp_path: Path):
    args = picker_config(tmp_path)
    with Stack(StackOptions(upstreams=1, sim_args=SIM, extproc_args=args)) as stack:
        model = stack.fleet.model
        async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
            await warm_up(c, model)
            decoding = asyncio.get_running_loop().create_future()
            # 40 tokens at 20 a second: it runs ~2 s past its stream's end (the headers).
            assert await stream_reply(c, model, 1, decoding, output=40) == "complete"
        await asyncio.to_thread(
            wait_until, lambda: metric(stack, UNCUTTABLE) == 1, timeout_s=5, what="uncuttable"
        )
        assert "nothing could cut it" in stack.logs("extproc")


async def test_calibration_leaves_the_cut_request_out_of_its_pairing(tmp_path: Path):
    """The engine counts a request's prompt at its finish and never a cut one's (vLLM
    0.32, the simulator). Paired in placement order, the cut request's placement (a long
    prompt here) stayed at the head of calibration's queue and every later count paired with
    the placement before its own: the window read the long estimate for a short request.
    Paired at each request's end, completed ones only, it reads the engine's own ratio."""
    opts = StackOptions(
        upstreams=1, sim_args=SIM, extproc_args=picker_config(tmp_path), bootstrap=with_trailers
    )
    with Stack(opts) as stack:
        await cut_then_calibrate(stack)


async def cut_then_calibrate(stack: Stack) -> float:
    """One request cut, then short ones: returns the engine's tokens per estimate of the
    short ones (what a window of them should read), once the picker's window read it."""
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        long = distinct_chat(model, 12, OUTPUT, words=1000)
        first, second = await both_decoding(c, distinct_chat(model, 11, OUTPUT), long)
        crit = distinct_chat(model, 13, 5, stream=False)
        r = await c.post("/v1/chat/completions", json=crit,
                         headers={"x-llm-d-inference-objective": "critical"})  # fmt: skip
        assert r.status_code == 200
        assert await asyncio.wait_for(second, 5) == "truncated"
        finish_fast(stack.fleet)
        assert await first == "complete"
        # Short requests, one at a time: the engine's tokens per estimate of the same ones.
        before = sim_figure(stack, "request_prompt_tokens_sum")
        estimates = 0
        for seed in range(20, 30):
            body = distinct_chat(model, seed, 1, words=400, stream=False)
            estimates += estimated_prompt_tokens(body)
            r = await c.post("/v1/chat/completions", json=body,
                             headers={"x-llm-d-inference-objective": "critical"})  # fmt: skip
            assert r.status_code == 200
        truth = (sim_figure(stack, "request_prompt_tokens_sum") - before) / estimates
    await asyncio.to_thread(
        wait_until,
        lambda: metric(stack, "extproc_approx_token_ratio") > 0,
        timeout_s=5,
        what="a calibration window",
    )
    ratio = metric(stack, "extproc_approx_token_ratio")
    assert abs(ratio / truth - 1) < 0.05, (ratio, truth)  # 0.18 off when paired in order
    assert metric(stack, "extproc_approx_windows_skipped_total") == 0
    assert metric(stack, "extproc_approx_pairing_cut_total") >= 1
    return truth


async def test_a_peer_replica_leaves_the_cut_request_out_too(tmp_path: Path, redis_server):
    """Two replicas pooling calibration through Redis (`state.shared_calibration`, on by
    default with a Redis index): the second runs beside the first, not behind Envoy, so its
    windows hold the first's placements only. A peer's placement joined its pairing queue
    when placed, the cut one included, and its window read the long estimate for a short
    request as the first replica's had before pairing at the end; the first now tells it
    which of its requests completed, and it pairs those only."""
    opts = StackOptions(
        upstreams=1,
        sim_args=SIM,
        extproc_args=picker_config(tmp_path),
        bootstrap=with_trailers,
        redis_url=redis_server.url,
    )
    with Stack(opts) as stack:
        peer = (free_port(), free_port(), free_port())
        stack.start_extproc(peer, name="extproc-peer")
        truth = await cut_then_calibrate(stack)

        def peer_metric(name: str) -> float:
            text = httpx.get(f"http://127.0.0.1:{peer[2]}/metrics", timeout=5).text
            return gauge(text, name) or 0.0

        await asyncio.to_thread(
            wait_until,
            lambda: peer_metric("extproc_approx_token_ratio") > 0,
            timeout_s=5,
            what="the peer's calibration window",
        )
        ratio = peer_metric("extproc_approx_token_ratio")
        assert abs(ratio / truth - 1) < 0.05, (ratio, truth)
        assert peer_metric("extproc_shared_calibration_completed_total") >= 10
        assert peer_metric("extproc_decisions_total") == 0  # placed nothing itself
