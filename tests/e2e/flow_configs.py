"""Picker configs the flow-control tests share: the reserve tests' two bands (interactive 10,
batch 0, named in an objectives file), a token concurrency detector, one scorer and
per-endpoint admission with a reserve for one higher-band request; one band under a token
ceiling that counts output (the max_tokens tests); and a plain scheduling section whose
saturation signal is the in-flight request count. Also the picker's metrics the flow tests
read: any by pattern, and its queue length; and the reserve tests' requests and their size as
the picker estimates it."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import httpx
import yaml

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import distinct_chat, estimated_prompt_tokens


def reserve_body(model: str, seed: int, words: int, max_tokens: int) -> dict:
    """A streamed chat request of `words` words from `seed` (two seeds share no block: every
    token is uncached work, which the reserve tests size their servers by)."""
    return distinct_chat(model, seed, max_tokens, words=words)


def reserve_estimate(words: int) -> int:
    """The prompt tokens the picker counts for a `reserve_body` of `words` words."""
    return estimated_prompt_tokens(reserve_body("m", 0, words, 1))


# The two bands of `two_band_reserve_config`, as request headers.
HI = {"x-llm-d-inference-objective": "interactive"}
LO = {"x-llm-d-inference-objective": "batch"}


def two_band_reserve_config(
    tmp: Path,
    scorer: str,
    max_tokens_in_flight: int,
    fairness: str | None = None,
    **flow_control: Any,
) -> Path:
    """Writes the config (and its objectives file) into `tmp`; returns the config's path.
    `fairness`: the interactive band's fairness policy (default: llm-d's global strict).
    `flow_control` adds to or overrides extproc's own `flow_control` section."""
    objectives = tmp / "objectives.yaml"
    objectives.write_text(yaml.safe_dump({"interactive": 10, "batch": 0}))
    detector = {"concurrencyMode": "tokens", "maxTokenConcurrency": max_tokens_in_flight}
    cfg = {
        "parse": {"calibrate": False},
        "state": {"request_end": {"mode": "access-log"}},  # in flight until the stream ends
        "scheduling": {
            "plugins": [
                {"type": scorer},
                {"type": "max-score-picker"},
                {"type": "concurrency-detector", "parameters": detector},
                *([{"type": fairness}] if fairness else []),
            ],
            "flowControl": {
                "defaultRequestTTL": "60s",
                "priorityBands": [
                    {"priority": 10, **({"fairnessPolicyRef": fairness} if fairness else {})},
                    {"priority": 0},
                ],
                "saturationDetector": {"pluginRef": "concurrency-detector"},
            },
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": scorer}, {"pluginRef": "max-score-picker"}],
                }
            ],
        },
        "flow_control": {
            "admit_per_endpoint": True,
            "reserve_for_higher_bands": 1,
            "objectives_file": str(objectives),
            **flow_control,
        },
    }
    path = tmp / "picker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def prefill_gate_config(tmp: Path, gate: dict[str, Any], **flow_control: Any) -> Path:
    """The prefill-gate tests' config: `two_band_reserve_config` with the queue scorer, KV
    room that never holds anything, no reserve and no output counted, plus `prefill-gate`
    with `gate` as its parameters. `flow_control` adds to extproc's own section."""
    path = two_band_reserve_config(
        tmp,
        "queue-scorer",
        1_000_000,  # KV room never holds anything here
        reserve_for_higher_bands=0,
        expected_output_tokens=0,
        **flow_control,
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["scheduling"]["plugins"].append({"type": "prefill-gate", "parameters": gate})
    path.write_text(yaml.safe_dump(cfg))
    return path


@contextlib.contextmanager
def reserve_stack(
    tmp: Path,
    cap: int,
    sim_args: Sequence[str] = ("--decode-tps", "100"),
    fairness: str | None = None,
    redis_url: str | None = None,
    **flow_control: Any,
) -> Iterator[Stack]:
    """Envoy, `extproc serve` on `two_band_reserve_config` (the token-load scorer, `cap`
    tokens per server, sizes counted as prompts alone: exact thresholds, the interactive
    band's `fairness` policy, plus `flow_control`) and two simulated servers (`sim_args`);
    with `redis_url`, its index and flow state in that Redis (shared with any peers)."""
    flow_control = {"expected_output_tokens": 0, **flow_control}
    path = two_band_reserve_config(tmp, "token-load-scorer", cap, fairness, **flow_control)
    opts = StackOptions(
        upstreams=2,
        sim_args=tuple(sim_args),
        extproc_args=("--config", str(path)),
        redis_url=redis_url,
    )
    with Stack(opts) as s:
        yield s


async def long_one(
    c: httpx.AsyncClient, body: Callable[[int], dict], seed: int, headers: dict,
    at: asyncio.Future[str],
) -> int:  # fmt: skip
    """Streams `body(seed)` to its end; `at` gets the server that took it as soon as its
    headers arrive (while it still streams). Returns the status."""
    async with c.stream("POST", "/v1/chat/completions", json=body(seed), headers=headers) as r:
        at.set_result(r.headers[SERVED_BY_HEADER])
        async for _ in r.aiter_lines():
            pass
        return r.status_code


async def start_streaming(
    c: httpx.AsyncClient, model: str, seed: int, words: int, max_tokens: int, headers: dict
) -> tuple[asyncio.Task[int], str]:
    """A streamed `reserve_body` sent in the background (`long_one`): the task that streams
    it to its end (its status), and the server that took it, once its headers arrive (up
    to 30 s)."""
    at: asyncio.Future[str] = asyncio.get_running_loop().create_future()

    def body(s: int) -> dict:
        return reserve_body(model, s, words, max_tokens)

    task = asyncio.create_task(long_one(c, body, seed, headers, at))
    return task, await asyncio.wait_for(at, 30)


@contextlib.contextmanager
def refill_credit_stack(
    tmp: Path, cap: int, credit: str, horizon_s: float, expected_output_tokens: int
) -> Iterator[Stack]:
    """`reserve_stack` for the refill-credit tests: `reserve_refill_credit: credit` over
    `horizon_s`, the reserve from the interactive band's own sizes once it has
    QUANTILE_TRUSTED of them (before, it keeps room for the largest request of any band),
    servers decoding 50 tokens/s and prefilling at 20x the sim's default speed, so the
    reserve's arrival-rate term (the band's rate times its largest prefill) stays small
    next to the half reserve these tests' ceilings leave for it."""
    flow = {
        "reserve_refill_s": horizon_s,
        "reserve_refill_credit": credit,
        "reserve_quantile": 0.9,
        "expected_output_tokens": expected_output_tokens,
    }
    sim = ("--decode-tps", "50", "--prefill-tps", "200000")
    with reserve_stack(tmp, cap, sim, **flow) as s:
        yield s


async def burst_then_large(
    stack: Stack, c: httpx.AsyncClient, burst: Sequence[dict], large: dict
) -> None:
    """Interactive history: `burst` sent at once, then `large` alone; returns once the
    picker holds none of them in flight (their counts end with their access-log entries)."""
    sent = [c.post("/v1/chat/completions", json=b, headers=HI) for b in burst]
    assert all(r.status_code == 200 for r in await asyncio.gather(*sent))
    r = await c.post("/v1/chat/completions", json=large, headers=HI)
    assert r.status_code == 200
    await inflight_ended(stack)


def in_flight_scheduling(max_concurrency: int = 100) -> dict[str, Any]:
    """A `scheduling` section: the queue scorer, and flow control saturated by in-flight
    requests (upstreams that export no metrics, or tests that must not depend on them)."""
    return {
        "plugins": [
            {"type": "queue-scorer"},
            {"type": "max-score-picker"},
            {"type": "concurrency-detector", "parameters": {"maxConcurrency": max_concurrency}},
        ],
        "flowControl": {"saturationDetector": {"pluginRef": "concurrency-detector"}},
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
            }
        ],
    }


def output_ceiling_config(
    tmp: Path, max_tokens_in_flight: int, output_per_request: int, expected_output: int
) -> Path:
    """One band under a token ceiling that counts `output_per_request` output tokens per
    in-flight request besides its prompt (`outputTokens`), the queue scorer, per-endpoint
    admission, requests in flight until their access-log entry. Returns the config's path."""
    detector = {"concurrencyMode": "tokens", "maxTokenConcurrency": max_tokens_in_flight,
                "outputTokens": output_per_request}  # fmt: skip
    scheduling = in_flight_scheduling()
    scheduling["plugins"][2]["parameters"] = detector
    scheduling["flowControl"]["defaultRequestTTL"] = "60s"
    cfg = {
        "parse": {"calibrate": False},
        "state": {"request_end": {"mode": "access-log"}},  # in flight until the request ends
        "scheduling": scheduling,
        "flow_control": {"admit_per_endpoint": True, "expected_output_tokens": expected_output},
    }
    path = tmp / "picker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def metric_sum(
    stack: Stack, pattern: str, *, present: bool = True, admin_port: int | None = None
) -> float:
    """The sum of the picker's metric values `pattern` matches (a regular expression over
    each line of its /metrics, its one group the value). `present`: at least one line must
    match (a misspelt name then fails the test instead of reading 0); False for series that
    appear only once used (a band's queue). `admin_port`: another replica's (default: the
    first picker's)."""
    port = stack.picker_admin_port if admin_port is None else admin_port
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text
    found = re.findall(pattern, text, re.M)
    assert found or not present, f"no metric matches {pattern}"
    return sum(float(m) for m in found)


async def inflight_ended(stack: Stack, tries: int = 100) -> None:
    """Waits (up to `tries` x 50 ms) until the picker holds no request in flight: in-flight
    counts end with each request's access-log entry, after the client has its answer."""
    for _ in range(tries):
        if not await asyncio.to_thread(
            metric_sum, stack, r"^extproc_inflight_tokens{.*} (\S+)$", present=False
        ):
            return
        await asyncio.sleep(0.05)


async def held_or_done(
    stack: Stack, task: asyncio.Task[Any], tries: int = 100, every_s: float = 0.05
) -> None:
    """Returns once `task` (a lower-band request) has ended or the picker holds one band-0
    request, polling `tries` times `every_s` apart; the caller asserts which."""
    for _ in range(tries):
        if task.done() or await asyncio.to_thread(queued, stack, 0) == 1:
            return
        await asyncio.sleep(every_s)


def queued(stack: Stack, priority: int | None = None) -> float:
    """Requests waiting in the picker's flow-control queues now: every band's and flow's, or
    only band `priority`'s."""
    band = "" if priority is None else f'[^}}]*priority="{priority}"'
    return metric_sum(stack, rf"^extproc_flow_queue_requests{{{band}[^}}]*}} (\S+)$", present=False)
