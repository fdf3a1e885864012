"""KV-event loss: a forwarder between a simulated server and the picker drops and reorders
messages, then the server restarts (sequence back to 0, cache empty). The picker's index view
of the endpoint must end equal to the server's true GPU cache (`/sim/cache`).

    sim PUB --connect--> [forwarder: SUB bind | drop 15 %, swap 10 % | PUB bind] <--dial-- picker
    sim ROUTER (replay) <------------------------------------------------------- picker heals gaps
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import aiohttp
import zmq
import zmq.asyncio

from extproc.config import decode_settings
from extproc.endpoints import parse_endpoints
from extproc.index.memory import MemoryKVIndex
from extproc.index.prefix import parse_tag
from extproc.server.app import App
from extproc.sim.engine import EngineSettings
from extproc.sim.kvevents import KVEventsSettings
from extproc.sim.server import ServerSettings, SimServer
from extproc.sim.timing import TimingSettings
from extproc.stack import SIM_TOKENIZER_DIR, free_port
from tests.reliability.conftest import figure

GPU_BLOCKS = 192  # small: the workload evicts, so BlockRemoved matters as much as BlockStored


@dataclass
class Forwarder:
    """Passes ZMQ messages from `in_url` (bound SUB) to `out_url` (bound PUB), dropping
    `drop` and swapping `swap` of them with the next one while `lossy`."""

    in_port: int
    out_port: int
    drop: float = 0.15
    swap: float = 0.10
    lossy: bool = False
    seen: int = 0
    dropped: int = 0
    swapped: int = 0

    async def run(self) -> None:
        ctx = zmq.asyncio.Context()
        sub, pub = ctx.socket(zmq.SUB), ctx.socket(zmq.PUB)
        rng = random.Random(5)
        held: list[bytes] | None = None
        try:
            sub.setsockopt(zmq.SUBSCRIBE, b"")
            sub.bind(f"tcp://127.0.0.1:{self.in_port}")
            pub.bind(f"tcp://127.0.0.1:{self.out_port}")
            while True:
                frames = await sub.recv_multipart()
                self.seen += 1
                if self.lossy and rng.random() < self.drop:
                    self.dropped += 1
                    continue
                if self.lossy and held is None and rng.random() < self.swap:
                    held = frames  # sent after the next one: a reorder
                    self.swapped += 1
                    continue
                await pub.send_multipart(frames)
                if held is not None:
                    await pub.send_multipart(held)
                    held = None
        finally:
            sub.close(0)
            pub.close(0)
            ctx.term()


@contextlib.asynccontextmanager
async def sim(http_port: int, fwd_in: int, replay_port: int) -> AsyncIterator[SimServer]:
    kv = KVEventsSettings(
        endpoint=f"tcp://127.0.0.1:{fwd_in}",
        bind=False,
        replay_endpoint=f"tcp://127.0.0.1:{replay_port}",
    )
    engine = EngineSettings(timing=TimingSettings(speed=50.0), num_gpu_blocks=GPU_BLOCKS)
    async with SimServer(ServerSettings(port=http_port, engine=engine, kv_events=kv)) as srv:
        yield srv


def index_view(index: MemoryKVIndex, endpoint: str) -> set[int]:
    """Block keys the index says `endpoint` holds on GPU (test introspection of the fake)."""
    out = set()
    for key, records in index._blocks.items():
        for tag, _ in records:
            addr, medium, *_ = parse_tag(tag)
            if addr == endpoint and medium == "GPU":
                out.add(key)
    return out


async def true_gpu_keys(http: aiohttp.ClientSession, url: str) -> set[int]:
    async with http.get(f"{url}/sim/cache") as r:
        doc = await r.json()
    return {b["key"] for b in doc["blocks"] if b["medium"] == "GPU"}


async def traffic(http: aiohttp.ClientSession, url: str, n: int, seed: int) -> None:
    rng = random.Random(seed)

    async def one(i: int) -> None:
        group = rng.randrange(12)
        text = f"group {group} " + "shared context words " * 20 + f"question {i} {rng.random()}"
        body = {"model": "tiny", "prompt": text, "max_tokens": 4}
        async with http.post(f"{url}/v1/completions", json=body) as r:
            assert r.status == 200, await r.text()

    for start in range(0, n, 8):
        await asyncio.gather(*(one(i) for i in range(start, min(n, start + 8))))


async def converged(app: App, http: aiohttp.ClientSession, srv: SimServer) -> tuple[bool, str]:
    for _ in range(100):
        await asyncio.sleep(0.05)
        want, have = await true_gpu_keys(http, srv.url), index_view(app.index, srv.name)
        if want == have:
            return True, f"{len(want)} keys"
    return False, f"missing {len(want - have)}, extra {len(have - want)} of {len(want)}"


async def test_index_converges_to_true_cache_after_loss_reorder_and_publisher_restart():
    http_port, fwd_in, fwd_out, replay = free_port(), free_port(), free_port(), free_port()
    endpoint = f"127.0.0.1:{http_port}"
    settings = decode_settings(
        {
            "endpoints": [endpoint],
            "server": {"host": "127.0.0.1", "port": 0, "health_port": 0, "admin_port": None},
            "state": {"scrape": None},
            "parse": {
                "precise": {
                    "tokenizer_dir": str(SIM_TOKENIZER_DIR),
                    "model": "tiny",
                    "block_size": 16,
                    "image_token": "<|pad|>",
                }
            },
            "index": {"kv_events": {"port": fwd_out, "replay_port": replay}},
        }
    )
    fwd = Forwarder(fwd_in, fwd_out)
    async with contextlib.AsyncExitStack() as stack:
        fwd_task = asyncio.create_task(fwd.run())
        stack.push_async_callback(_cancel, fwd_task)
        app = await stack.enter_async_context(App(settings, parse_endpoints(endpoint)))
        http = await stack.enter_async_context(aiohttp.ClientSession())
        sub = app.subscriber
        assert sub is not None
        async with sim(http_port, fwd_in, replay) as srv:
            await asyncio.sleep(0.5)  # PUB/SUB connect: events before that are never seen
            await traffic(http, srv.url, 8, seed=1)
            ok, detail = await converged(app, http, srv)
            assert ok, f"no loss yet, and still apart: {detail}"
            # Lossy phase: drops and swaps; then a few messages pass cleanly, so the last gap
            # is noticed (a gap is only visible when a later message arrives).
            fwd.lossy = True
            await traffic(http, srv.url, 120, seed=2)
            fwd.lossy = False
            await traffic(http, srv.url, 4, seed=3)
            ok, detail = await converged(app, http, srv)
            stats = sub.stats
            figure(
                "kv_loss",
                messages_seen=fwd.seen,
                dropped=fwd.dropped,
                swapped=fwd.swapped,
                gaps=stats.gaps,
                replayed=stats.replayed,
                resyncs=stats.resyncs,
                restarts=stats.restarts,
                converged=ok,
                detail=detail.replace(" ", "_"),
            )
            assert fwd.dropped > 5 and fwd.swapped > 3, "the injection did not happen"
            assert ok, f"index did not converge after loss: {detail}"
        # Publisher restart: a new server on the same address, sequence from 0, empty cache.
        before = sub.stats.restarts
        async with sim(http_port, fwd_in, replay) as srv:
            await asyncio.sleep(0.5)
            await traffic(http, srv.url, 30, seed=4)
            ok, detail = await converged(app, http, srv)
            figure("kv_restart", restarts_seen=sub.stats.restarts - before, converged=ok)
            assert sub.stats.restarts > before
            assert ok, f"index did not converge after the publisher restarted: {detail}"


async def _cancel(task: asyncio.Task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def test_a_late_message_is_ignored_not_taken_for_a_publisher_restart():
    """Regression: a message delayed past later ones (seq behind, earlier timestamp) used to
    count as a restart and wipe the endpoint from the index."""
    import msgpack

    from extproc.index.kvevents import EventIngest

    def batch(ts: float, *events: object) -> bytes:
        return msgpack.packb([ts, list(events), 0])

    def stored(h: int, tokens: list[int], parent: int | None = None) -> dict:
        return {
            "type": "BlockStored",
            "block_hashes": [h],
            "parent_block_hash": parent,
            "token_ids": tokens,
            "block_size": 4,
        }

    index = MemoryKVIndex()
    ingest = EventIngest(index, "127.0.0.1:1", "tiny", block_size=4)
    await ingest.handle(0, batch(1.0, stored(1, [1, 2, 3, 4])))
    await ingest.handle(2, batch(3.0, stored(3, [9, 9, 9, 9])))  # gap at 1, no replay: resync
    await ingest.handle(3, batch(4.0, stored(4, [5, 5, 5, 5])))
    held = index_view(index, "127.0.0.1:1")
    await ingest.handle(1, batch(2.0, stored(2, [5, 6, 7, 8], parent=1)))  # the late one
    assert ingest.stats.late_messages == 1
    assert ingest.stats.restarts == 0
    assert index_view(index, "127.0.0.1:1") == held and held
    # A real restart (sequence back, later timestamp) still resets.
    await ingest.handle(1, batch(5.0, stored(7, [8, 8, 8, 8])))
    assert ingest.stats.restarts == 1
    assert len(index_view(index, "127.0.0.1:1")) == 1
