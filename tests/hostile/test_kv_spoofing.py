"""Issue 18 attack 3: KV-event spoofing. A picker in precise mode binds its KV-event socket
(`index.kv_events.bind`); a pool member publishes from its own address, a rogue process on
another address publishes the same prompts as cached on a different pool member (and on an
address outside the pool). Only the member's own events count: the rogue's change no
routing decision. Real ZMQ over TCP; publishers choose their source address with libzmq's
`tcp://source;destination` form."""

from __future__ import annotations

import asyncio
from typing import Any

import msgpack
import orjson
import pytest
import zmq

from extproc.stack import SIM_TOKENIZER_DIR, free_port
from extproc.testing import ExtProcClient, body_chunks, destination, post, request_headers
from tests.reliability.conftest import figure
from tests.reliability.harness import picker

MODEL = "sim-model"
BS = 16
HONEST, VICTIM = "127.0.0.11:8000", "127.0.0.12:8000"
OUTSIDER = "127.0.0.13:8000"  # not in the pool
ROGUE_SOURCE = "127.0.0.1"


def prompt(i: int) -> bytes:
    text = f"Patient record {i}: " + "history of the case in many words. " * 30
    return orjson.dumps({"model": MODEL, "messages": [{"role": "user", "content": text}]})


def stored_batch(token_ids: list[int], first_hash: int) -> bytes:
    n = len(token_ids) // BS
    event = {
        "type": "BlockStored",
        "block_hashes": list(range(first_hash, first_hash + n)),
        "parent_block_hash": None,
        "token_ids": token_ids[: n * BS],
        "block_size": BS,
        "lora_id": None,
        "medium": "GPU",
        "lora_name": None,
    }
    return msgpack.packb([0.0, [event], 0])


class Publisher:
    """A PUB socket connected to the picker from `source`, publishing as `endpoint`."""

    def __init__(
        self, ctx: zmq.Context[Any], source: str, url: str, endpoint: str, curve=None
    ) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        if curve is not None:  # (server public key, (own public, own secret)), before connect
            self.sock.curve_serverkey = curve[0]
            self.sock.curve_publickey, self.sock.curve_secretkey = curve[1]
        host, port = url.removeprefix("tcp://").rsplit(":", 1)
        self.sock.connect(f"tcp://{source}:0;{host}:{port}")
        self.topic = f"kv@{endpoint}@{MODEL}".encode()
        self.seq = 0

    async def subscribed(self) -> None:
        async with asyncio.timeout(10):
            while not self.sock.poll(0):
                await asyncio.sleep(0.01)
        self.sock.recv()

    def send(self, payload: bytes) -> None:
        self.sock.send_multipart([self.topic, self.seq.to_bytes(8, "big"), payload])
        self.seq += 1


@pytest.mark.parametrize("curve", [False, True], ids=["address-check", "curve"])
async def test_a_rogue_publisher_changes_no_routing(curve: bool):
    bind = f"tcp://127.0.0.1:{free_port()}"
    kv: dict[str, Any] = {"bind": bind}
    server_pub = honest_pair = rogue_pair = None
    if curve:
        server_pub, server_secret = zmq.curve_keypair()
        honest_pair, rogue_pair = zmq.curve_keypair(), zmq.curve_keypair()
        kv |= {
            "curve_secret_key": server_secret.decode(),
            "curve_publisher_keys": [honest_pair[0].decode()],
        }
    sections = {
        "parse": {
            "precise": {"tokenizer_dir": str(SIM_TOKENIZER_DIR), "model": MODEL, "block_size": BS}
        },
        "index": {"kv_events": kv},
        # Cache affinity alone: the test asks whether forged events move routing, so no
        # load or session-spreading scorer may move it for its own reasons (the default
        # profile spreads ten new sessions over two servers).
        "scheduling": {
            "plugins": [{"type": "prefix-cache-scorer"}, {"type": "max-score-picker"}],
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [
                        {"pluginRef": "prefix-cache-scorer", "weight": 1},
                        {"pluginRef": "max-score-picker"},
                    ],
                }
            ],
        },
    }
    ctx: zmq.Context[Any] = zmq.Context()
    try:
        async with (
            picker([HONEST, VICTIM], **sections) as app,
            ExtProcClient(f"127.0.0.1:{app.port}") as client,
        ):
            sub = app.subscriber
            assert sub is not None
            prompts = [prompt(i) for i in range(20)]
            tokens = []
            for body in prompts:
                req = app.router.parse("/v1/chat/completions", {}, body)
                tokens.append(app.precise.token_ids(req.prompt)[0])  # type: ignore[union-attr]

            def publisher(source: str, endpoint: str, pair) -> Publisher:
                return Publisher(
                    ctx, source, bind, endpoint, None if pair is None else (server_pub, pair)
                )

            async def route_all() -> list[str]:
                out = []
                for body in prompts:
                    msgs = [request_headers(post("/v1/chat/completions")), *body_chunks(body)]
                    out.append(destination((await client.exchange(msgs))[0]))
                return out

            async def settle(count: int) -> None:
                async with asyncio.timeout(10):
                    while sub.stats.messages + sub.stats.rejected < count:
                        await asyncio.sleep(0.01)
                await app.index.flush()  # type: ignore[union-attr]

            # The honest member says it holds the first 10 prompts.
            honest = publisher("127.0.0.11", HONEST, honest_pair)
            await honest.subscribed()
            for i in range(10):
                honest.send(stored_batch(tokens[i], 1000 * i))
            await settle(10)
            before = await route_all()

            # The rogue claims every prompt as cached on the victim (longer chains), and on
            # an address outside the pool; also with a key the picker does not know (CURVE).
            rogues = [
                publisher(ROGUE_SOURCE, VICTIM, rogue_pair),
                publisher(ROGUE_SOURCE, OUTSIDER, rogue_pair),
            ]
            if not curve:
                for r in rogues:
                    await r.subscribed()
            else:
                await asyncio.sleep(1.0)  # CURVE handshakes fail: nothing to wait for
            seen = sub.stats.messages + sub.stats.rejected
            for r in rogues:
                for i in range(20):
                    r.send(stored_batch(tokens[i] + tokens[i], 5000 + 100 * i))
            if not curve:
                await settle(seen + 40)
            else:
                await asyncio.sleep(1.0)
            after = await route_all()
            for p in (honest, *rogues):
                p.sock.close(linger=0)
            stats = sub.stats
    finally:
        ctx.destroy(linger=0)
    changed = sum(a != b for a, b in zip(before, after, strict=True))
    figure(
        f"kv_event_spoofing[{'curve' if curve else 'address-check'}]",
        honest_prompts_on_honest=sum(d == HONEST for d in before[:10]),
        routing_changed=changed,
        rogue_routed_to_victim=sum(d == VICTIM for d in after[:10]),
        messages_ingested=stats.messages,
        rejected=stats.rejected,
    )
    assert before[:10] == [HONEST] * 10, "the honest publisher's events did not count"
    assert changed == 0
    if not curve:
        assert stats.rejected == 40
