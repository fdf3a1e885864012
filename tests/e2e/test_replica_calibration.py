"""Three `extproc serve` replicas sharing one Redis behind one Envoy each learn the engines'
characters per token (extproc/calibration.py), though each places only about a third of an
engine's requests.

Calibration compared a replica's token estimates for the requests it placed on a server
with everything the server's engine counted: each replica saw ~3x its estimates, read it as
foreign traffic, skipped every window and kept its configured bytes per token, where one
replica learns the simulator's ~1.3 characters per token. Its token estimates (predicted
TTFT's prefill cost, the KV-capacity model's written tokens, in-flight tokens) then stayed
~3x low on every replica (issue 14, seventh session). It now compares tokens per request
(the engine's `request_prompt_tokens` histogram against its mean estimate).

One server, so every replica places on the same engine; the filler goes in small batches
until every replica has changed, or fails after a bound far above what one replica needs.

A fourth replica runs beside them, sharing the Redis but not behind Envoy: it places
nothing. With `state.shared_calibration` (server/shared_calibration.py; on by default with
a Redis index: `auto`) the others' placements fill its windows and their confirmed value
reaches it, and a fifth started after the fleet calibrated reads the fleet's value from
Redis; with `shared_calibration: false`, the idle one keeps its configured value."""

from __future__ import annotations

import asyncio
import random
import time

import aiohttp
import httpx
import pytest

from extproc.sim.workload import send_one
from extproc.stack import Stack, StackOptions, free_port
from tests.e2e.calibration_workload import SIM, chat_item, gauge, syllable_text
from tests.redis_servers import RedisServer

# From 3 bytes per token the simulator's ~1.3 characters per token is a ratio of ~2.3 per
# request (inside calibration's bounds); in total, for a replica with a third of the
# requests, ~7 (outside them).
PARSE = "parse: {bytes_per_token: 3}\n"
# Each replica needs two windows of >= 8 of its own requests: ~48 requests in all with
# three replicas. The bound leaves room for windows lost to misalignment.
MAX_REQUESTS = 360


NAMES = (
    "approx_bytes_per_token", "decisions_total", "approx_recalibrations_adopted_total",
    "shared_calibration_applied_total",
)  # fmt: skip


def _gauges(admin: int) -> dict[str, float | None]:
    text = httpx.get(f"http://127.0.0.1:{admin}/metrics", timeout=10).text
    return {k: gauge(text, f"extproc_{k}") for k in NAMES}


def _idle_replica(stack: Stack, name: str) -> int:
    """One more `extproc serve` on the stack's Redis and servers, not behind Envoy: it
    places nothing. Its admin port."""
    ports = (free_port(), free_port(), free_port())
    stack.start_extproc(ports, name=name)
    return ports[2]


def _settle(admin: int, want: float, timeout_s: float = 5.0) -> dict[str, float | None]:
    """The replica's figures once its bytes per token is `want`, or after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while (g := _gauges(admin))["approx_bytes_per_token"] != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.1)
    return g


async def _scenario(stack: Stack) -> tuple[int, list[dict[str, float | None]]]:
    admins = [stack.picker_admin_port, *(a for _, _, a in stack.replica_ports)]
    rng = random.Random(5)
    async with aiohttp.ClientSession() as s, httpx.AsyncClient(timeout=10) as h:

        async def gauges() -> list[dict[str, float | None]]:
            texts = [(await h.get(f"http://127.0.0.1:{p}/metrics")).text for p in admins]
            names = ("approx_bytes_per_token", "decisions_total")
            return [{k: gauge(t, f"extproc_{k}") for k in names} for t in texts]

        n = 0
        while any(g["approx_bytes_per_token"] == 3 for g in await gauges()):
            if n >= MAX_REQUESTS:
                break
            batch = [
                chat_item(n + i, f"filler {n + i}: " + syllable_text(rng, 500)) for i in range(6)
            ]
            n += len(batch)
            done = await asyncio.gather(*(send_one(s, stack.url, b, 30) for b in batch))
            assert all(r.status == 200 for r in done), [r.error for r in done]
            await asyncio.sleep(0.2)  # a few scrapes between batches
        return n, await gauges()


@pytest.mark.parametrize("shared", [False, True], ids=["own", "shared"])
def test_every_replica_learns_characters_per_token_from_its_share_of_requests(
    tmp_path, redis_server: RedisServer, shared: bool
):
    cfg = tmp_path / "picker.yaml"
    # Shared: the default (auto, with this Redis index); own: turned off.
    cfg.write_text(PARSE + ("" if shared else "state: {shared_calibration: false}\n"))
    opts = StackOptions(
        upstreams=1,
        sim_args=SIM,
        replicas=3,
        redis_url=redis_server.url,
        extproc_args=("--config", str(cfg)),
    )
    with Stack(opts) as stack:
        idle_admin = _idle_replica(stack, "extproc-idle")
        sent, after = asyncio.run(_scenario(stack))
        # Sharing: the idle replica follows at once; alone it has nothing to learn from
        # (a few scrapes' time would do if it could).
        idle = _settle(idle_admin, 1 if shared else 3, timeout_s=5 if shared else 1)
        late = _settle(_idle_replica(stack, "extproc-late"), 1) if shared else None
    why = (sent, after, idle, late)
    # Envoy spread the requests over the replicas (each placed a share, none all of them).
    # Alone, a replica calibrates on windows of >= 8 of its own placements; sharing pools
    # the fleet's, so a replica may be calibrated having placed fewer (6 each, 18 in all, seen).
    own_window = 1 if shared else 8
    assert all((g["decisions_total"] or 0) >= own_window for g in after), why
    assert all((g["decisions_total"] or 0) < sent for g in after), why
    # Every replica moved from 3 to the engines' ~1.3 characters per token.
    assert all(g["approx_bytes_per_token"] == 1 for g in after), why
    assert not idle["decisions_total"], why  # placed nothing itself
    if not shared:
        assert idle["approx_bytes_per_token"] == 3, why
        assert idle["shared_calibration_applied_total"] is None, why  # not pooling at all
        return
    # The idle replica calibrated from the others' placements (or adopted their value).
    assert (
        idle["approx_bytes_per_token"] == 1 and (idle["shared_calibration_applied_total"] or 0) > 0
    ), why
    # The late one, with no placement said since it started, read the fleet's value.
    assert late is not None and late["approx_bytes_per_token"] == 1, why
    assert late["approx_recalibrations_adopted_total"] == 1, why
