"""A lookup's budget follows what the lookup is worth: a Redis that answers in 100 ms (CPU
load, a far link) is waited for when the request's prompt would take longer than that to
prefill, and abandoned at the configured budget when not (or when no speed is known)."""

from __future__ import annotations

from extproc.core import Endpoint, InferenceRequest
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.index.base import IndexOptions
from extproc.index.redis import RedisKVIndex
from extproc.router import Router
from extproc.scheduling.config import build_scheduler, default_config
from extproc.testing import plugin_registry
from tests.redis_servers import RedisServer
from tests.reliability.harness import DelayProxy

DELAY_S = 0.1
KEYS = tuple(range(1, 33))


async def _router(url: str, *, follows: bool, speeds: PrefillSpeeds) -> tuple[Router, RedisKVIndex]:
    index = RedisKVIndex.from_url(url, options=IndexOptions(), lookup_budget_s=0.005)
    await index.__aenter__()
    pool = EndpointPool([Endpoint("s1"), Endpoint("s2")])
    router = Router(
        pool=pool,
        scheduler=build_scheduler(default_config(), plugin_registry()),
        parser=lambda *_: None,  # type: ignore[arg-type,return-value]
        index=index,
        speeds=speeds,
        lookup_budget_follows_prefill=follows,
    )
    return router, index


def _request(tokens: int) -> InferenceRequest:
    return InferenceRequest("r", "/v1/completions", prompt_tokens=tokens, block_keys=KEYS,
                            block_tokens=16)  # fmt: skip


async def test_a_slow_redis_is_waited_for_when_the_prompt_is_worth_it(redis_server: RedisServer):
    speeds = PrefillSpeeds()
    speeds.add("s1", 10_000.0)  # a 20,000-token prompt: 2 s of prefill, worth a 0.1 s wait
    async with DelayProxy(redis_server.port, DELAY_S / 2) as proxy:
        url = f"redis://127.0.0.1:{proxy.port}"
        router, index = await _router(url, follows=True, speeds=speeds)
        try:
            await index.lookup(KEYS[:1], budget_s=5.0)  # the connection is set up
            long = await router.route_request(_request(20_000), place=False)
            short = await router.route_request(_request(100), place=False)  # 10 ms of prefill
        finally:
            await index.aclose()
        fixed, fixed_index = await _router(url, follows=False, speeds=speeds)
        try:
            await fixed_index.lookup(KEYS[:1], budget_s=5.0)
            fixed_long = await fixed.route_request(_request(20_000), place=False)
        finally:
            await fixed_index.aclose()
    assert not long.lookup.degraded
    assert short.lookup.degraded
    assert fixed_long.lookup.degraded
    no_speed, no_speed_index = await _router(redis_server.url, follows=True, speeds=PrefillSpeeds())
    try:
        assert no_speed._lookup_budget(_request(20_000)) is None  # the configured budget
    finally:
        await no_speed_index.aclose()
