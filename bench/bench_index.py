"""KV-block index benchmark: lookup latency (memory vs Redis, same run), KV-event ingestion
throughput from a real ZMQ publisher, and Redis memory per block.

    uv run python bench/bench_index.py [--redis-url redis://host:port] [--iterations 2000]

Without --redis-url a throwaway `redis-server` is started on a free loopback port.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import subprocess
import tempfile
import threading
import time

import zmq
from msgspec import msgpack

from extproc.index.base import IndexOptions
from extproc.index.memory import MemoryKVIndex
from extproc.index.redis import RedisKVIndex
from extproc.index.subscriber import EventSource, KVEventSubscriber
from extproc.stack import free_port

ENDPOINTS = [f"10.0.0.{i}:8000" for i in range(1, 9)]


async def _lookup_latency(index, keys: list[int], iterations: int) -> list[float]:
    for _ in range(50):
        await index.lookup(keys)
    samples = []
    for _ in range(iterations):
        t0 = time.perf_counter()
        result = await index.lookup(keys)
        samples.append(time.perf_counter() - t0)
        assert not result.degraded and result.matches
    return samples


def _pct(samples: list[float], q: float) -> float:
    return sorted(samples)[int(q * (len(samples) - 1))] * 1e3


async def bench_lookup(url: str, iterations: int) -> None:
    print("## lookup latency (ms), 8 endpoints hold the prefix (4 fully, 4 half)")
    cols = ("mem p50", "mem p99", "redis p50", "redis p99", "ratio p50")
    print(f"{'keys':>6} " + " ".join(f"{c:>10}" for c in cols))
    memory = MemoryKVIndex()
    async with RedisKVIndex.from_url(url, namespace="bench", lookup_budget_s=0.5) as redis:
        for n in (64, 512, 2048):
            keys = [(n << 40) + i for i in range(n)]
            for i, ep in enumerate(ENDPOINTS):
                part = keys if i < 4 else keys[: n // 2]
                memory.record(ep, part)
                redis.record(ep, part)
            await redis.flush()
            mem = await _lookup_latency(memory, keys, iterations)
            red = await _lookup_latency(redis, keys, iterations)
            print(
                f"{n:>6} {_pct(mem, 0.5):>8.3f} {_pct(mem, 0.99):>8.3f} {_pct(red, 0.5):>10.3f} "
                f"{_pct(red, 0.99):>10.3f} {statistics.median(red) / statistics.median(mem):>9.1f}x"
            )


def _publish(
    url_holder: list[str], payloads: list[bytes], ready: threading.Event, go: threading.Event
) -> None:
    ctx = zmq.Context()
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind("tcp://127.0.0.1:*")
    url_holder.append(pub.getsockopt_string(zmq.LAST_ENDPOINT))
    ready.set()
    pub.recv()  # the subscription
    go.wait()
    for seq, payload in enumerate(payloads):
        pub.send_multipart([b"kv@bench", seq.to_bytes(8, "big"), payload])
    time.sleep(1)
    pub.close(linger=0)
    ctx.destroy(linger=0)


async def bench_ingest(index, label: str, messages: int, blocks_per_msg: int, bs: int) -> None:
    payloads = []
    h = 0
    for m in range(messages):
        tokens = [(m * 7 + i) % 50_000 for i in range(blocks_per_msg * bs)]
        hashes = list(range(h, h + blocks_per_msg))
        h += blocks_per_msg
        event = {
            "type": "BlockStored",
            "block_hashes": hashes,
            "parent_block_hash": None,
            "token_ids": tokens,
            "block_size": bs,
            "medium": "GPU",
        }
        payloads.append(msgpack.encode([time.time(), [event], 0]))
    holder: list[str] = []
    ready, go = threading.Event(), threading.Event()
    thread = threading.Thread(target=_publish, args=(holder, payloads, ready, go), daemon=True)
    thread.start()
    ready.wait()
    sub = KVEventSubscriber(index, model="bench", block_size=bs)
    sub.watch(EventSource("10.0.0.1:8000", holder[0]))
    task = asyncio.create_task(sub.run())
    await asyncio.sleep(0.3)
    total = messages * blocks_per_msg
    t0 = time.perf_counter()
    go.set()
    while sub.stats.blocks_stored < total:
        await asyncio.sleep(0.001)
    t_events = time.perf_counter() - t0
    await index.flush()
    t_all = time.perf_counter() - t0
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    thread.join()
    print(
        f"{label:>8}: {total} blocks in {t_all:.2f}s -> {total / t_all:,.0f} blocks/s "
        f"(events decoded+keyed: {total / t_events:,.0f} blocks/s)"
    )


async def bench_memory_cost(url: str) -> None:
    from redis.asyncio import Redis

    print("## Redis memory per block (MEMORY USAGE, 2048-block chain)")
    client = Redis.from_url(url)
    for n_eps in (1, 4):
        ns = f"mem{n_eps}"
        async with RedisKVIndex.from_url(url, namespace=ns, options=IndexOptions()) as index:
            keys = [(1 << 50) + i for i in range(2048)]
            for ep in ENDPOINTS[:n_eps]:
                index.store(ep, keys, root=keys[0])
            await index.flush()
        root = await client.memory_usage(f"{ns}:b:{{{keys[0]:016x}}}", samples=0)
        track = await client.memory_usage(f"{ns}:e:{{{ENDPOINTS[0]}}}", samples=0)
        print(
            f"{n_eps} endpoint(s): chain hash {root / 2048:.0f} B/block, "
            f"endpoint set {track / 2048:.0f} B/block/endpoint, "
            f"total {(root + n_eps * track) / 2048:.0f} B/block"
        )
    await client.aclose()


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--redis-url")
    ap.add_argument("--iterations", type=int, default=2000)
    ap.add_argument("--messages", type=int, default=20_000)
    ap.add_argument("--blocks-per-message", type=int, default=16)
    ap.add_argument("--block-size", type=int, default=16)
    args = ap.parse_args()
    proc = None
    url = args.redis_url
    if url is None:
        port = free_port()
        workdir = tempfile.mkdtemp()
        proc = subprocess.Popen(
            [
                shutil.which("redis-server") or "redis-server",
                "--port",
                str(port),
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                workdir,
            ],
            stdout=subprocess.DEVNULL,
        )
        time.sleep(0.3)
        url = f"redis://127.0.0.1:{port}"
    try:
        await bench_lookup(url, args.iterations)
        print("## KV-event ingestion (ZMQ PUB thread -> subscriber -> index)")
        await bench_ingest(
            MemoryKVIndex(), "memory", args.messages, args.blocks_per_message, args.block_size
        )
        async with RedisKVIndex.from_url(url, namespace="ingest") as redis:
            await bench_ingest(
                redis, "redis", args.messages, args.blocks_per_message, args.block_size
            )
        await bench_memory_cost(url)
    finally:
        if proc is not None:
            proc.kill()
            proc.wait()


if __name__ == "__main__":
    asyncio.run(main())
