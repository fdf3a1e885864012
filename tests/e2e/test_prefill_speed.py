"""Prefill speeds as `extproc serve` learns them behind Envoy, on identical simulated
servers one of which was made to queue: both read the same speed, the engine's (issue 14:
learned from time to first byte, queueing included, identical servers read 980 and 3,888
tok/s in one run, and predicted TTFT sent new prompts to the fastest-measured one).

A burst of requests sharing a long prefix all go to its holder (the prefix scorer alone
decides) and wait there one behind another; new prompts, one at a time, go round the fleet
(`no-hit-lru-scorer`) and wait nowhere. Time to first byte on the holder is then up to
~12x its prefill, on the other server 1x; what the engines' histograms say is the same."""

from __future__ import annotations

import asyncio
import random

import httpx

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions

# 20,000 prompt tokens/s per server in wall time (5,000 x 4).
SIM = ("--fast", "4", "--prefill-tps", "5000", "--num-gpu-blocks", "4000")
TRUE_TPS = 20000.0
CONFIG = """
parse: {block_tokens: 16, bytes_per_token: 1}
scheduling:
  plugins:
    - {type: prefix-cache-scorer}
    - {type: no-hit-lru-scorer}
    - {type: max-score-picker}
  schedulingProfiles:
    - name: default
      plugins:
        - {pluginRef: prefix-cache-scorer, weight: 10}
        - {pluginRef: no-hit-lru-scorer, weight: 1}
        - {pluginRef: max-score-picker}
"""
WORDS = ("alpha", "bravo", "delta", "echo", "golf", "hotel", "india", "kilo", "lima", "mike")
BURST = 12


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def body(content: str) -> dict:
    return {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": content}]}


def metrics(port: int) -> dict[str, float]:
    out = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        if line.startswith(
            (
                "extproc_prefill_tokens_per_second{",
                "extproc_prefill_speed_",
                "extproc_prefill_overlap{",
            )
        ):
            name, value = line.rsplit(" ", 1)
            out[name] = float(value)
    return out


async def burst(url: str, prompts: list[str]) -> list[str]:
    async with httpx.AsyncClient(timeout=60) as http:
        rs = await asyncio.gather(
            *(http.post(f"{url}/v1/chat/completions", json=body(p)) for p in prompts)
        )
    assert all(r.status_code == 200 for r in rs), [r.text for r in rs]
    return [r.headers[SERVED_BY_HEADER] for r in rs]


def test_identical_servers_read_the_same_speed_though_one_queued(tmp_path):
    rng = random.Random(7)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(CONFIG)
    shared = "shared context. " + text(rng, 500)
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:

        def send(content: str) -> str:
            r = http.post(f"{stack.url}/v1/chat/completions", json=body(content))
            assert r.status_code == 200, r.text
            return r.headers[SERVED_BY_HEADER]

        holder = send(shared + " first.")
        for _ in range(2):
            # Long distinct tails: each queued request has ~2,000 tokens of its own to prefill.
            tails = [f"{shared} burst {i}: {text(rng, 400)}" for i in range(BURST)]
            served = asyncio.run(burst(stack.url, tails))
            assert set(served) == {holder}, served
            # New prompts, one at a time: no queue anywhere; both servers take some.
            alone = [send(f"new {i}: " + text(rng, 400)) for i in range(8)]
            assert len(set(alone)) == 2, alone
        port = stack.picker_admin_port
        # The last requests' intervals reach the learner at the next scrapes.
        for _ in range(50):
            m = metrics(port)
            if m.get('extproc_prefill_speed_endpoints{source="engine"}') == 2:
                break
            asyncio.run(asyncio.sleep(0.1))
    speeds = {k: v for k, v in m.items() if k.startswith("extproc_prefill_tokens_per_second")}
    assert len(speeds) == 2, m
    lo, hi = min(speeds.values()), max(speeds.values())
    assert hi / lo < 1.2, m
    # The simulator's prefill: its speed, less a fixed step overhead per request.
    assert lo > 0.8 * TRUE_TPS and hi < 1.2 * TRUE_TPS, m
    assert m.get('extproc_prefill_speed_endpoints{source="access_log"}') == 0, m
    # Read by the busy estimator: on the holder, the queued prefills shared its steps (each
    # prompt spans two 2,048-token steps), so its requests' prefill seconds summed are about
    # twice its busy seconds (the per-request speed read 10,416 vs 19,593 tok/s); the other
    # server prefilled one prompt at a time.
    assert m.get('extproc_prefill_speed_estimator{estimator="busy"}') == 1, m
    overlaps = sorted(v for k, v in m.items() if k.startswith("extproc_prefill_overlap{"))
    assert len(overlaps) == 2 and overlaps[0] < 1.2 and overlaps[1] > 1.5, m
