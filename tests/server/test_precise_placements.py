"""Precise mode through the router: prompt sizes in the engine's tokens (the unit matched
blocks are counted in), and the picker's own placements credited until the engine's KV
events can speak for them (index/placed.py). No publisher runs: the events say nothing."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import orjson
import pytest

from extproc.config import IndexSettings, KVEventSettings, Settings
from extproc.endpoints import parse_endpoints
from extproc.hashing.tokenizer import PreciseSettings
from extproc.server.app import App
from extproc.stack import free_port
from extproc.testing import post

TOKENIZER = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu" / "tokenizer"
PATH = "/v1/chat/completions"
CHAT = orjson.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "a shared prefix " * 200}]}
)


def precise(settings: Settings, *, credit: bool = True) -> Settings:
    events = KVEventSettings(bind=f"tcp://127.0.0.1:{free_port()}", credit_placements=credit)
    return msgspec.structs.replace(
        settings,
        index=IndexSettings(kv_events=events),
        parse=msgspec.structs.replace(
            settings.parse,
            precise=PreciseSettings(tokenizer_dir=str(TOKENIZER), model="tiny", block_size=16),
        ),
    )


@pytest.fixture
async def precise_app(settings: Settings) -> AsyncIterator[App]:
    s = precise(settings)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        yield app


async def test_prompt_tokens_are_the_engines_and_in_flight_tokens_what_it_lacks(
    precise_app: App,
):
    router = precise_app.router
    assert router._precise is not None
    req = router.parse(PATH, post(PATH), CHAT)
    assert req.prompt is not None
    ids, _ = router._precise.token_ids(req.prompt)
    assert req.prompt_tokens == len(ids)
    # An endpoint reported holding the first half of the prompt's blocks.
    held = len(req.block_keys) // 2
    target = router.pool.snapshot()[0].address
    assert precise_app.index is not None
    precise_app.index.store(target, req.block_keys[:held], root=req.block_keys[0])
    routed = await router.route(PATH, post(PATH), CHAT, subset=[target])
    assert routed.lookup.matches[target] == held
    # The placement counts the part of the prompt the endpoint lacks, in the same unit.
    assert routed.placement.tokens == len(ids) - held * 16 > 0
    router.finish(routed)


async def test_a_placed_prompt_counts_on_its_endpoint_until_the_response(precise_app: App):
    router = precise_app.router
    first = await router.route(PATH, post(PATH), CHAT)
    n = len(first.request.block_keys)
    where = first.decision.primary.address
    # No KV event yet (nothing publishes), but the picker knows where it just sent it.
    second = await router.route(PATH, post(PATH), CHAT)
    assert second.lookup.matches == {where: n}
    assert second.decision.primary.address == where
    router.finish(first)
    router.finish(second)
    # Both responses came: from now on only the engine's events count.
    third = await router.route(PATH, post(PATH), CHAT)
    assert third.lookup.matches == {}
    router.finish(third)
    assert router.placed is not None and router.placed.stats.pending == 1


async def test_without_the_credit_only_events_count(settings: Settings):
    s = precise(settings, credit=False)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        first = await app.router.route(PATH, post(PATH), CHAT)
        second = await app.router.route(PATH, post(PATH), CHAT)
        assert second.lookup.matches == {}
        assert app.router.placed is None
        app.router.finish(first)
        app.router.finish(second)
