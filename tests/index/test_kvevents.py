"""KV-event ingestion over real ZMQ sockets, in vLLM's wire format (both event encodings) and
with frames captured from a real vLLM 0.32 (tests/fixtures/vllm-0.32-cpu)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
import zmq
from msgspec.structs import asdict

from extproc.hashing.precise import chain_seed, token_block_keys
from extproc.index.base import IndexOptions, KVIndex
from extproc.index.kvevents import decode_batch
from extproc.index.memory import MemoryKVIndex
from extproc.index.subscriber import EventSource, KVEventSubscriber, endpoint_from_topic
from extproc.server.families import KV_EVENTS

from .conftest import IndexFactory

FIXTURES = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu"
EP = "127.0.0.1:8000"
MODEL = "tiny"
BS = 4  # synthetic events use small blocks


def captured(folder: str) -> tuple[list[list[bytes]], list[dict[str, Any]]]:
    frames = [
        [bytes.fromhex(h) for h in json.loads(line)["frames_hex"]]
        for line in (FIXTURES / folder / "frames.jsonl").read_text().splitlines()
    ]
    requests = [
        json.loads(line) for line in (FIXTURES / folder / "requests.jsonl").read_text().splitlines()
    ]
    return frames, requests


def prompt_keys(req: dict[str, Any], block_size: int = 32) -> list[int]:
    salt = req["request"].get("cache_salt")
    return token_block_keys(
        req["prompt_token_ids"], block_size, chain_seed(MODEL), [[salt]] if salt else None
    )


def stored(
    hashes: list[Any],
    tokens: list[int],
    parent: Any = None,
    *,
    as_map: bool = True,
    medium: str = "GPU",
    group: int = 0,
    kind: str = "full_attention",
    window: int | None = None,
    extra: Any = None,
    lora: str | None = None,
) -> Any:
    fields = {
        "block_hashes": hashes,
        "parent_block_hash": parent,
        "token_ids": tokens,
        "block_size": BS,
        "lora_id": None,
        "medium": medium,
        "lora_name": lora,
        "extra_keys": extra,
        "group_idx": group,
        "kv_cache_spec_kind": kind,
        "kv_cache_spec_sliding_window": window,
    }
    return {"type": "BlockStored", **fields} if as_map else ["BlockStored", *fields.values()]


def removed(hashes: list[Any], *, as_map: bool = True, medium: str = "GPU", group: int = 0) -> Any:
    if as_map:
        return {
            "type": "BlockRemoved",
            "block_hashes": hashes,
            "medium": medium,
            "group_idx": group,
        }
    return ["BlockRemoved", hashes, medium, group]


def cleared(*, as_map: bool = True) -> Any:
    return {"type": "AllBlocksCleared"} if as_map else ["AllBlocksCleared"]


def batch(*events: Any) -> bytes:
    return msgpack.packb([1.0, list(events), 0])


def toks(start: int, blocks: int) -> list[int]:
    return list(range(start, start + blocks * BS))


def keys_of(tokens: list[int]) -> list[int]:
    return token_block_keys(tokens, BS, chain_seed(MODEL))


class Publisher:
    """A vLLM-like publisher: XPUB (wire-compatible with PUB) so tests can wait for the
    subscription instead of sleeping."""

    def __init__(self, ctx: zmq.Context[Any], topic: bytes = b"kv-events") -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.topic = topic
        self.seq = 0

    def bind(self) -> str:
        self.sock.bind("tcp://127.0.0.1:*")
        return self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    async def subscribed(self, timeout_s: float = 5.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not self.sock.poll(0):
                await asyncio.sleep(0.005)
        self.sock.recv()

    def send(self, payload: bytes, seq: int | None = None) -> None:
        seq = self.seq if seq is None else seq
        self.sock.send_multipart([self.topic, seq.to_bytes(8, "big"), payload])
        self.seq = seq + 1


@pytest.fixture
def zctx() -> Iterator[zmq.Context[Any]]:
    ctx: zmq.Context[Any] = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


@contextlib.asynccontextmanager
async def running(sub: KVEventSubscriber) -> AsyncIterator[KVEventSubscriber]:
    task = asyncio.create_task(sub.run())
    try:
        yield sub
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


async def until(cond: Callable[[], bool], timeout_s: float = 5.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not cond():
            await asyncio.sleep(0.005)


@contextlib.asynccontextmanager
async def dialing(
    index: KVIndex, zctx: zmq.Context[Any], replay_url: str | None = None
) -> AsyncIterator[tuple[KVEventSubscriber, Publisher]]:
    pub = Publisher(zctx)
    url = pub.bind()
    sub = KVEventSubscriber(index, model=MODEL, block_size=BS)
    sub.watch(EventSource(EP, url, replay_url))
    async with running(sub):
        await pub.subscribed()
        yield sub, pub
    pub.sock.close(linger=0)


async def match(index: KVIndex, keys: list[int]) -> float:
    await index.flush()
    return (await index.lookup(keys)).matches.get(EP, 0.0)


# -- captured vLLM frames -------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["memory", "redis"])
async def test_captured_int_hash_frames_index_the_prompts_vllm_cached(
    backend: str, zctx: zmq.Context[Any], request: pytest.FixtureRequest
) -> None:
    url = request.getfixturevalue("redis_server").url if backend == "redis" else None
    index = await IndexFactory(backend, url).open(IndexOptions())
    frames, reqs = captured("A-sha256-int-bs32")
    try:
        async with dialing(index, zctx) as (sub, pub):
            for topic, seq, payload in frames:
                pub.sock.send_multipart([topic, seq, payload])
            await until(lambda: sub.stats.messages == len(frames))
        by_name = {r["name"]: r for r in reqs}
        assert await match(index, prompt_keys(by_name["c1"])) == 1.0
        assert await match(index, prompt_keys(by_name["ch1"])) == 2.0
        assert await match(index, prompt_keys(by_name["salt1"])) == 1.0
        salted_only = prompt_keys(by_name["salt1"])[0]
        assert salted_only != prompt_keys(by_name["c1"])[0]
        assert sub.stats.malformed == 0 and sub.stats.orphan_blocks == 0
    finally:
        await index.__aexit__(None, None, None)


async def test_captured_bytes_hash_frames_follow_evictions_and_reset(
    zctx: zmq.Context[Any],
) -> None:
    index = MemoryKVIndex()
    frames, reqs = captured("B-sha256cbor-bytes-bs32-evict-reset-full")
    async with dialing(index, zctx) as (sub, pub):
        for topic, seq, payload in frames:
            pub.sock.send_multipart([topic, seq, payload])
        await until(lambda: sub.stats.messages == len(frames))
    by_name = {r["name"]: r for r in reqs}  # the second "c1" wins; same prompt
    assert await match(index, prompt_keys(by_name["evict2"])) == 4.0
    assert await match(index, prompt_keys(by_name["evict3"])) == 4.0
    for evicted in ("evict1", "c1", "long1", "salt1"):
        assert await match(index, prompt_keys(by_name[evicted])) == 0.0, evicted
    assert sub.stats.clears == 1
    assert sub.stats.duplicate_stores == 1  # c3 re-stored c1's block (60 tokens, bs 32)
    assert sub.stats.unknown_removals == 0


def test_both_encodings_decode_to_the_same_events() -> None:
    as_map = batch(stored([1, 2], toks(0, 2)), removed([2]), cleared())
    as_array = batch(
        stored([1, 2], toks(0, 2), as_map=False), removed([2], as_map=False), cleared(as_map=False)
    )
    (from_map, bad_map), (from_array, bad_array) = decode_batch(as_map), decode_batch(as_array)
    assert bad_map == bad_array == 0
    assert [asdict(e) for e in from_map] == [asdict(e) for e in from_array]
    for a, b in zip(from_map, from_array, strict=True):
        assert isinstance(b, type(a))


def test_array_events_may_omit_trailing_defaults() -> None:
    events, skipped = decode_batch(
        msgpack.packb([1.0, [["BlockStored", [7], None, toks(0, 1), BS]]])
    )
    assert skipped == 0
    assert events[0].block_hashes == [7] and events[0].medium is None


# -- behaviour over real sockets -------------------------------------------------------------


@pytest.mark.parametrize("as_map", [True, False])
async def test_stored_chain_pieces_and_removal(as_map: bool, zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    tokens = toks(100, 4)
    keys = keys_of(tokens)
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([b"h0", b"h1"], tokens[: 2 * BS], as_map=as_map)))
        pub.send(batch(stored([b"h2", b"h3"], tokens[2 * BS :], b"h1", as_map=as_map)))
        await until(lambda: sub.stats.messages == 2)
        assert await match(index, keys) == 4.0
        pub.send(batch(removed([b"h2"], as_map=as_map)))
        await until(lambda: sub.stats.messages == 3)
        assert await match(index, keys) == 2.0


async def test_duplicate_store_needs_two_removes(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    tokens = toks(0, 1)
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([11], tokens), stored([11], tokens)))
        pub.send(batch(removed([11])))
        await until(lambda: sub.stats.messages == 2)
        assert await match(index, keys_of(tokens)) == 1.0
        pub.send(batch(removed([11])))
        await until(lambda: sub.stats.messages == 3)
        assert await match(index, keys_of(tokens)) == 0.0


async def test_ingestion_lag_is_measured_from_the_batch_timestamp(
    zctx: zmq.Context[Any],
) -> None:
    index = MemoryKVIndex()
    async with dialing(index, zctx) as (sub, pub):
        sent_at = time.time() - 5.0  # a batch stamped 5 s ago
        pub.send(msgpack.packb([sent_at, [stored([11], toks(0, 1))], 0]))
        await until(lambda: sub.stats.messages == 1)
    assert 5.0 <= sub.stats.lag_s < 60.0


async def test_all_blocks_cleared_drops_the_endpoint(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    index.record("10.9.9.9:8000", keys_of(toks(0, 2)))
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([1, 2], toks(0, 2)), cleared(), stored([3], toks(50, 1))))
        await until(lambda: sub.stats.messages == 1)
    assert (await index.lookup(keys_of(toks(0, 2)))).matches == {"10.9.9.9:8000": 2.0}
    assert await match(index, keys_of(toks(50, 1))) == 1.0


async def test_all_blocks_cleared_is_told_after_the_index_dropped_the_endpoint(
    zctx: zmq.Context[Any],
) -> None:
    # The router's figures of what was written there (predicted TTFT's eviction model) go
    # with the cache: told once per clear, the index already empty for the endpoint.
    index = MemoryKVIndex()
    told: list[tuple[str, float]] = []

    def cleared_at(endpoint: str) -> None:
        told.append((endpoint, index.held_blocks(endpoint)))

    pub = Publisher(zctx)
    url = pub.bind()
    sub = KVEventSubscriber(index, model=MODEL, block_size=BS, on_cleared=cleared_at)
    sub.watch(EventSource(EP, url))
    async with running(sub):
        await pub.subscribed()
        pub.send(batch(stored([1, 2], toks(0, 2)), removed([2])))
        pub.send(batch(cleared(), stored([3], toks(50, 1))))
        await until(lambda: sub.stats.messages == 2)
    pub.sock.close(linger=0)
    assert told == [(EP, 0)]
    assert await match(index, keys_of(toks(50, 1))) == 1.0


async def test_lora_and_extra_keys_change_the_keys(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    tokens = toks(0, 2)
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([1, 2], tokens, lora="sql", extra=[["img-1"], None])))
        await until(lambda: sub.stats.messages == 1)
    assert await match(index, keys_of(tokens)) == 0.0
    expected = token_block_keys(tokens, BS, chain_seed(MODEL, "sql"), [["img-1"], None])
    assert await match(index, expected) == 2.0


async def test_cpu_medium_is_a_lower_tier(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    tokens = toks(0, 2)
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([1, 2], tokens), stored([1, 2], tokens, medium="CPU")))
        pub.send(batch(removed([1, 2])))
        await until(lambda: sub.stats.messages == 2)
    assert await match(index, keys_of(tokens)) == pytest.approx(1.6)


async def test_gap_without_replay_resyncs_the_endpoint(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([1], toks(0, 1))))
        pub.send(batch(stored([2], toks(10, 1))), seq=5)  # 1..4 lost
        await until(lambda: sub.stats.messages == 2)
        assert sub.stats.gaps == 1 and sub.stats.resyncs == 1
        assert sub.ingest(EP) is not None and sub.ingest(EP).is_stale  # type: ignore[union-attr]
    assert await match(index, keys_of(toks(0, 1))) == 0.0  # could have been removed meanwhile
    assert await match(index, keys_of(toks(10, 1))) == 1.0


async def test_gap_is_healed_from_the_replay_endpoint(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    replay_url = router.getsockopt_string(zmq.LAST_ENDPOINT)
    buffered = {i: batch(stored([10 + i], toks(10 * i, 1))) for i in range(4)}

    async def serve_replay() -> None:
        while True:
            while not router.poll(0):
                await asyncio.sleep(0.002)
            client, _, start = router.recv_multipart()
            for seq in range(int.from_bytes(start, "big"), 4):
                router.send_multipart(
                    [client, b"", b"kv-events", seq.to_bytes(8, "big"), buffered[seq]]
                )
            router.send_multipart(
                [client, b"", b"kv-events", (-1).to_bytes(8, "big", signed=True), b""]
            )

    server = asyncio.create_task(serve_replay())
    try:
        async with dialing(index, zctx, replay_url) as (sub, pub):
            pub.send(buffered[0], seq=0)
            pub.send(buffered[3], seq=3)  # 1 and 2 lost on the PUB socket
            await until(lambda: sub.stats.messages == 4)
            assert sub.stats.replayed == 2 and sub.stats.resyncs == 0
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close(linger=0)
    for i in range(4):
        assert await match(index, keys_of(toks(10 * i, 1))) == 1.0


async def test_sequence_restart_drops_the_endpoint(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([1], toks(0, 1))))
        pub.send(batch(stored([2], toks(10, 1))))
        pub.send(batch(stored([1], toks(20, 1))), seq=0)  # the engine came back
        await until(lambda: sub.stats.messages == 3)
        assert sub.stats.restarts == 1
    assert await match(index, keys_of(toks(0, 1))) == 0.0
    assert await match(index, keys_of(toks(20, 1))) == 1.0


async def test_malformed_frames_are_counted_and_skipped(
    zctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="extproc.index")
    index = MemoryKVIndex()
    async with dialing(index, zctx) as (sub, pub):
        pub.sock.send_multipart([b"kv-events", b"short"])  # two frames
        pub.send(b"\xc1 not msgpack")
        pub.send(batch({"type": "NewKindOfEvent"}, stored([1], toks(0, 1)), ["BlockStored", "x"]))
        pub.send(batch(stored([2], [10**12] * BS)))  # token id out of range
        await until(lambda: sub.stats.messages == 3)
        assert sub.stats.malformed == 5
        for _ in range(10):  # a publisher that keeps sending garbage
            pub.send(b"\xc1 not msgpack")
        await until(lambda: sub.stats.messages == 13)
        fam = next(f for f in KV_EVENTS.families(sub.stats) if f.name.endswith("malformed"))
        assert fam.samples[0].value == 15
        # The nonsensical event cost itself: its batch's sequence was taken, no false gap.
        assert sub.stats.gaps == 0 and sub.stats.resyncs == 0
    assert await match(index, keys_of(toks(0, 1))) == 1.0
    # Said, one line per reason (frames, batch, events, nonsense) however often it repeats.
    lines = [r.getMessage() for r in caplog.records if "skipped" in r.getMessage()]
    assert len(lines) == 4, lines


async def test_orphan_blocks_are_counted_not_guessed(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored([5, 6], toks(0, 2), parent=999)))
        await until(lambda: sub.stats.messages == 1)
        assert sub.stats.orphan_blocks == 2


async def test_hybrid_groups_follow_the_sliding_window_rule(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    tokens = toks(0, 6)
    sw = {"group": 1, "kind": "sliding_window", "window": 2 * BS}
    async with dialing(index, zctx) as (sub, pub):
        pub.send(batch(stored(list(range(6)), tokens), stored(list(range(6)), tokens, **sw)))
        # The window group frees blocks that slid out of its window; full attention keeps all.
        pub.send(batch(removed([0, 1, 2], group=1)))
        await until(lambda: sub.stats.messages == 2)
        assert await match(index, keys_of(tokens)) == 6.0
        pub.send(batch(removed([5], group=1)))
        await until(lambda: sub.stats.messages == 3)
        # Cut after 5 blocks: the window (blocks 3, 4) is still there; after 6 it is not.
        assert await match(index, keys_of(tokens)) == 5.0


async def test_bound_socket_attributes_messages_by_topic(zctx: zmq.Context[Any]) -> None:
    index = MemoryKVIndex()
    sub = KVEventSubscriber(index, model="other", bind="tcp://127.0.0.1:*", block_size=BS)
    async with running(sub):
        await until(lambda: sub.bound_url is not None)
        pub = Publisher(zctx, topic=f"kv@127.0.0.1@{MODEL}".encode())
        pub.sock.connect(sub.bound_url)  # type: ignore[arg-type]
        await pub.subscribed()
        pub.send(batch(stored([1], toks(0, 1))))
        await until(lambda: sub.stats.messages == 1)
        pub.sock.close(linger=0)
    assert (await index.lookup(keys_of(toks(0, 1)))).matches == {"127.0.0.1:8000": 1.0}


async def test_each_message_attributed_to_a_member_is_heard(zctx: zmq.Context[Any]) -> None:
    """`on_message` (the silence watch's `heard`) sees every message the subscriber
    attributes to a pool endpoint, malformed payload or not, and none it refuses."""
    heard: list[str] = []
    sub = KVEventSubscriber(
        MemoryKVIndex(),
        model=MODEL,
        bind="tcp://127.0.0.1:*",
        block_size=BS,
        is_member=lambda endpoint: endpoint == EP,
        on_message=heard.append,
    )
    async with running(sub):
        await until(lambda: sub.bound_url is not None)
        ours = Publisher(zctx, topic=f"kv@{EP}@{MODEL}".encode())
        other = Publisher(zctx, topic=f"kv@127.0.0.1:9999@{MODEL}".encode())
        for pub in (ours, other):
            pub.sock.connect(sub.bound_url)  # type: ignore[arg-type]
            await pub.subscribed()
        ours.send(batch(stored([1], toks(0, 1))), seq=0)
        other.send(batch(stored([2], toks(4, 1))), seq=0)
        ours.send(b"not msgpack", seq=1)
        await until(lambda: sub.stats.messages == 2 and sub.stats.rejected == 1)
        ours.sock.close(linger=0)
        other.sock.close(linger=0)
    assert heard == [EP, EP]


def test_topic_parsing() -> None:
    assert endpoint_from_topic(b"kv@10.1.2.3@llama") == ("10.1.2.3:8000", "llama")
    assert endpoint_from_topic(b"kv@10.1.2.3:9000@m@x") == ("10.1.2.3:9000", "m@x")
    assert endpoint_from_topic(b"kv@[fd00::1]@m") == ("[fd00::1]:8000", "m")
    assert endpoint_from_topic(b"kv-events") is None


async def test_bound_socket_recovers_a_publishers_lost_head_by_replay(
    zctx: zmq.Context[Any],
) -> None:
    """vLLM's connecting PUB socket drops its first batch after every start (sent before the
    subscription handshake). The bound subscriber, given `replay_port`, asks the endpoint's
    host for batches from 0 when a publisher is first heard past 0, and again after a
    restart."""
    index = MemoryKVIndex()
    router = zctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.bind("tcp://127.0.0.1:*")
    replay_port = int(router.getsockopt_string(zmq.LAST_ENDPOINT).rpartition(":")[2])
    buffered: dict[int, bytes] = {}

    async def serve_replay() -> None:
        while True:
            while not router.poll(0):
                await asyncio.sleep(0.002)
            client, _, start = router.recv_multipart()
            for seq in sorted(s for s in buffered if s >= int.from_bytes(start, "big")):
                router.send_multipart(
                    [client, b"", b"kv-events", seq.to_bytes(8, "big"), buffered[seq]]
                )
            router.send_multipart(
                [client, b"", b"kv-events", (-1).to_bytes(8, "big", signed=True), b""]
            )

    server = asyncio.create_task(serve_replay())
    sub = KVEventSubscriber(
        index, model=MODEL, bind="tcp://127.0.0.1:*", block_size=BS, replay_port=replay_port
    )
    try:
        async with running(sub):
            await until(lambda: sub.bound_url is not None)
            pub = Publisher(zctx, topic=f"kv@{EP}@{MODEL}".encode())
            pub.sock.connect(sub.bound_url)  # type: ignore[arg-type]
            await pub.subscribed()
            buffered.update({0: batch(stored([1], toks(0, 1))), 1: batch(stored([2], toks(10, 1)))})
            pub.send(buffered[1], seq=1)  # seq 0 never reached us
            await until(lambda: sub.stats.messages == 2)
            assert sub.stats.replayed == 1 and sub.stats.gaps == 0
            assert await match(index, keys_of(toks(0, 1))) == 1.0

            # The engine restarts: a new sequence whose first batch is lost again.
            buffered.clear()
            buffered.update(
                {0: batch(stored([7], toks(30, 1))), 1: batch(stored([8], toks(40, 1)))}
            )
            pub.send(buffered[1], seq=1)
            await until(lambda: sub.stats.messages == 4)
            assert sub.stats.restarts == 1 and sub.stats.replayed == 2
            pub.sock.close(linger=0)
    finally:
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        router.close(linger=0)
    assert await match(index, keys_of(toks(0, 1))) == 0.0  # the old engine's blocks are gone
    assert await match(index, keys_of(toks(30, 1))) == 1.0
    assert await match(index, keys_of(toks(40, 1))) == 1.0


async def test_a_message_that_raises_is_said_with_its_traceback_once_per_interval(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A bug a publisher's messages keep hitting wrote one traceback per message before.
    sub = KVEventSubscriber(MemoryKVIndex(), model="m")

    async def raises(*_: Any) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(sub, "_dispatch", raises)
    with caplog.at_level(logging.ERROR, logger="extproc.index.subscriber"):
        for _ in range(50):
            await sub._dispatch_safely([b"t", b"\0" * 8, b"x"], "10.0.0.1:8000")
    assert sub.stats.malformed == 50
    said = [r for r in caplog.records if "skipped" in r.getMessage()]
    assert len(said) == 1 and said[0].exc_info is not None


async def test_a_publisher_that_goes_away_and_comes_back_is_said_each_way(
    zctx: zmq.Context[Any], caplog: pytest.LogCaptureFixture
) -> None:
    # Before, a publisher gone showed only as silence, which an idle engine's is too.
    caplog.set_level(logging.INFO, logger="extproc.index.subscriber")
    async with dialing(MemoryKVIndex(), zctx) as (sub, pub):
        url = pub.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        assert sub.stats.publishers_down == 0 and sub.stats.disconnects == 0
        pub.sock.close(linger=0)  # the engine's publisher goes away
        await until(lambda: sub.stats.publishers_down == 1)
        again = Publisher(zctx)
        again.sock.bind(url)  # ... and comes back on its address
        await again.subscribed()
        await until(lambda: sub.stats.publishers_down == 0)
        again.sock.close(linger=0)
    assert sub.stats.disconnects >= 1
    said = [r.getMessage() for r in caplog.records]
    assert any(f"publisher of {EP} disconnected" in m for m in said), said
    assert any(f"publisher of {EP} reconnected after" in m for m in said), said
