"""KV events on a real ZMQ SUB socket, compared with frames captured from vLLM 0.32."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import msgpack
import zmq
import zmq.asyncio

from extproc.hashing.precise import chain_seed, token_block_keys
from extproc.sim.kvevents import END_SEQ
from tests.sim.conftest import StartSim, decode, events_of

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu"
TEXT = "The router sends the prefix to the server today. The cache stores many blocks. "


def captured(folder: str) -> list[list[bytes]]:
    lines = (FIXTURES / folder / "frames.jsonl").read_text().splitlines()
    return [[bytes.fromhex(f) for f in json.loads(line)["frames_hex"]] for line in lines]


def shape(value: Any) -> Any:
    """The structure of a decoded value: map keys in order, element types, not contents."""
    if isinstance(value, dict):
        return [(k, shape(v)) for k, v in value.items()]
    if isinstance(value, list):
        return ["list", shape(value[0]) if value else None]
    return type(value).__name__


def first_event(messages: list[list[bytes]], kind: str) -> tuple[list[bytes], dict[str, Any]]:
    for m in messages:
        for ev in decode(m)[2][1]:
            if ev["type"] == kind:
                return m, ev
    raise AssertionError(f"no {kind} event")


async def complete(http: aiohttp.ClientSession, url: str, prompt: str, max_tokens: int = 1):
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens}
    async with http.post(f"{url}/v1/completions", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def test_frames_have_the_captured_vllm_structure(start_sim: StartSim, subscribe):
    for folder, hash_bytes in (("A-sha256-int-bs32", False),
                               ("B-sha256cbor-bytes-bs32-evict-reset-full", True)):  # fmt: skip
        real = captured(folder)
        async with start_sim(block_size=32, num_gpu_blocks=6, kv={"hash_bytes": hash_bytes}) as srv:
            sub = await subscribe(srv.kv_events_url)
            async with aiohttp.ClientSession() as http:
                # Distinct prompts of one full block and a partial one, which is reused
                # first (as vLLM does): the 7th evicts.
                for i in range(8):
                    await complete(http, srv.url, f"{i} {TEXT * 2}")
                async with http.post(f"{srv.url}/reset_prefix_cache") as resp:
                    assert resp.status == 200
            ours = await sub.drain()
        assert [len(m) for m in ours] == [3] * len(ours)
        assert [decode(m)[1] for m in ours] == list(range(len(ours)))
        for msgs in (real, ours):
            ts, events, rank = decode(msgs[0])[2]
            assert isinstance(ts, float) and isinstance(events, list) and rank == 0
            assert msgs[0][2][:2] == b"\x93\xcb"  # fixarray(3), float64 timestamp
        kinds = ["BlockStored"] + (["BlockRemoved", "AllBlocksCleared"] if hash_bytes else [])
        for kind in kinds:
            (_, theirs), (_, mine) = first_event(real, kind), first_event(ours, kind)
            assert shape(mine) == shape(theirs), kind


async def test_eviction_sends_block_removed_before_block_stored(start_sim: StartSim, subscribe):
    async with start_sim(num_gpu_blocks=8) as srv, aiohttp.ClientSession() as http:
        sub = await subscribe(srv.kv_events_url)
        for i in range(3):  # 3 prompts of 4 blocks in 8 blocks: the third evicts
            await complete(http, srv.url, f"{i} {TEXT * 3}")
        messages = await sub.drain()
        async with http.get(f"{srv.url}/sim/cache") as resp:
            truth = await resp.json()
    batches = [[ev["type"] for ev in decode(m)[2][1]] for m in messages]
    evicting = [b for b in batches if "BlockRemoved" in b]
    assert evicting, batches
    for b in evicting:
        assert b.index("BlockStored") > max(i for i, t in enumerate(b) if t == "BlockRemoved")
    # Replaying the events gives exactly the true cache content.
    held: dict[int, int] = {}
    for ev in events_of(messages):
        for h in ev.get("block_hashes", []):
            held[h] = held.get(h, 0) + (1 if ev["type"] == "BlockStored" else -1)
    assert {h for h, n in held.items() if n > 0} == {b["hash"] for b in truth["blocks"]}


async def test_event_token_ids_give_the_true_precise_keys(start_sim: StartSim, subscribe):
    async with start_sim() as srv, aiohttp.ClientSession() as http:
        sub = await subscribe(srv.kv_events_url)
        await complete(http, srv.url, TEXT * 3, max_tokens=20)
        events = events_of(await sub.drain())
        async with http.get(f"{srv.url}/sim/cache") as resp:
            truth = await resp.json()
    seed = chain_seed("tiny")
    by_hash = {b["hash"]: b for b in truth["blocks"]}
    keys: dict[int, int] = {}
    for ev in events:
        parent = seed if ev["parent_block_hash"] is None else keys[ev["parent_block_hash"]]
        computed = token_block_keys(ev["token_ids"], ev["block_size"], parent, ev["extra_keys"])
        keys.update(zip(ev["block_hashes"], computed, strict=True))
    assert len(events) == 2  # prompt blocks at admission, decode-filled blocks later
    assert keys == {h: b["key"] for h, b in by_hash.items()}


async def test_reset_sends_all_blocks_cleared(start_sim: StartSim, subscribe):
    async with start_sim() as srv, aiohttp.ClientSession() as http:
        sub = await subscribe(srv.kv_events_url)
        await complete(http, srv.url, TEXT)
        async with http.post(f"{srv.url}/reset_prefix_cache") as resp:
            assert resp.status == 200
        events = events_of(await sub.drain())
        async with http.get(f"{srv.url}/sim/cache") as resp:
            assert (await resp.json())["blocks"] == []
    assert events[-1] == {"type": "AllBlocksCleared"}


async def test_replay_returns_what_a_late_subscriber_missed(start_sim: StartSim, subscribe):
    async with start_sim(kv={"topic": "kv-events"}) as srv, aiohttp.ClientSession() as http:
        for i in range(3):
            await complete(http, srv.url, f"{i} {TEXT}")
        ctx = zmq.asyncio.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(srv.replay_url)
            await sock.send_multipart([b"", (1).to_bytes(8, "big")])
            replies = []
            while True:
                frames = await sock.recv_multipart()
                assert frames[:2] == [b"", b"kv-events"]  # delimiter, then 0.32's topic
                if frames[2] == END_SEQ:
                    assert frames[3] == b""
                    break
                replies.append(frames[2:])
        finally:
            sock.close(linger=0)
            ctx.term()
    seqs = [int.from_bytes(seq, "big") for seq, _ in replies]
    assert seqs == list(range(1, srv.publisher.next_seq))
    assert all(msgpack.unpackb(p)[1] for _, p in replies)


async def test_array_format_and_byte_hashes(start_sim: StartSim, subscribe):
    kv = {"event_format": "array", "hash_bytes": True}
    async with start_sim(kv=kv) as srv, aiohttp.ClientSession() as http:
        sub = await subscribe(srv.kv_events_url)
        await complete(http, srv.url, TEXT)
        [message] = await sub.drain()
    [event] = decode(message)[2][1]
    assert event[0] == "BlockStored"
    assert all(isinstance(h, bytes) and len(h) == 32 for h in event[1])
    assert event[4] == 16 and event[6] == "GPU"
