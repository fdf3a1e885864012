"""The prefill gate's spread of the top band behind a real Envoy: `extproc serve` with
per-endpoint admission and eviction (`evict_per_endpoint`, `lower-band-eviction-filter`,
response trailers sent so a running request can be cut), no reserve, and `prefill-gate` with
`spreadTopBandTokens` between one interactive prompt and two; two simulated servers with a
slow prefill.

Batch fills server Y past room for an interactive prompt and leaves X room for two. The
first interactive request goes to X (the only room). A second one sent while the first is
still in its prefill has KV room on X too, but there the two prompts would not fit one
engine step: it waits for Y's batch request to be cut and is served on Y. Without the
spread it went to X at once (sharing, and spilling out of, the first one's step)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import replace

import httpx
import pytest
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import distinct_chat
from tests.e2e.flow_configs import (
    HI,
    LO,
    metric_sum,
    reserve_estimate,
    start_streaming,
    two_band_reserve_config,
)
from tests.e2e.sim_speed import finish_fast

# Words per prompt: an interactive one (~300 picker tokens), a large batch one that leaves
# no room for it beside, a small one that leaves room for two.
HI_WORDS, BIG_WORDS, SMALL_WORDS = 150, 380, 150
HI_TOKENS = reserve_estimate(HI_WORDS)
CAP = HI_TOKENS * 3 + reserve_estimate(SMALL_WORDS) // 3
# One interactive prompt fits the step; two do not.
SPREAD = HI_TOKENS * 3 // 2
# The sim's tokenizer makes ~4x the picker's estimate: each interactive prefill takes ~1 s.
SIM = ("--prefill-tps", "1200", "--decode-tps", "20")


def with_trailers(opts: BootstrapOptions) -> dict:
    return build_bootstrap(replace(opts, response_trailers="send"))


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("spread")
    path = two_band_reserve_config(
        tmp,
        "token-load-scorer",
        CAP,
        reserve_for_higher_bands=0,
        expected_output_tokens=0,
        evict_per_endpoint=True,
    )
    cfg = yaml.safe_load(path.read_text())
    cfg["scheduling"]["plugins"] += [
        {"type": "prefill-gate", "parameters": {"spreadTopBandTokens": SPREAD}},
        {"type": "lower-band-eviction-filter"},
    ]
    cfg["scheduling"]["flowControl"]["enableEviction"] = True
    path.write_text(yaml.safe_dump(cfg))
    opts = StackOptions(
        upstreams=2, sim_args=SIM, extproc_args=("--config", str(path)), bootstrap=with_trailers
    )
    with Stack(opts) as s:
        yield s


def spread_total(stack: Stack) -> float:
    return metric_sum(stack, r"^extproc_flow_prefill_gate_spread_total (\S+)$")


async def test_a_close_second_interactive_prompt_gets_its_cut_on_the_other_server(stack: Stack):
    assert reserve_estimate(BIG_WORDS) + HI_TOKENS > CAP  # no room beside the big one
    assert reserve_estimate(BIG_WORDS) + reserve_estimate(SMALL_WORDS) > CAP
    assert HI_TOKENS < SPREAD < 2 * HI_TOKENS
    model = stack.fleet.model
    async with httpx.AsyncClient(base_url=stack.url, timeout=30) as c:
        big, y = await start_streaming(c, model, 1, BIG_WORDS, 200, LO)
        small, x = await start_streaming(c, model, 2, SMALL_WORDS, 200, LO)
        assert x != y  # the small one had room only beside nothing
        first, at = await start_streaming(c, model, 3, HI_WORDS, 1, HI)
        assert at == x
        # At once, while the first one's prefill is still under way there (~1 s).
        second = await c.post(
            "/v1/chat/completions",
            json=distinct_chat(model, 4, 1, words=HI_WORDS, stream=False),
            headers=HI,
        )
        assert second.status_code == 200, second.text
        assert second.headers[SERVED_BY_HEADER] == y
        assert spread_total(stack) >= 1
        # Y's batch request was cut for it; X's runs on.
        with pytest.raises((httpx.RemoteProtocolError, httpx.ReadError)):
            await asyncio.wait_for(big, 5)
        assert not small.done()
        finish_fast(stack.fleet)
        assert await first == 200 and await small == 200
    cut = r'^extproc_flow_endpoint_evictions_total\{[^}]*outcome="cut"[^}]*\} (\S+)$'
    assert metric_sum(stack, cut) == 1
