"""A 400 KB prompt through Envoy and `extproc serve`: routed, and its whole chain of block
keys recorded in the index (the bulk write path), so the same prompt matches in full next."""

from __future__ import annotations

import random

import httpx
import orjson

from extproc.stack import Stack, StackOptions

WORDS = [
    "the",
    "router",
    "sends",
    "prefix",
    "server",
    "cache",
    "stores",
    "many",
    "blocks",
    "quickly",
    "request",
    "reads",
]


def chat_body(size: int) -> bytes:
    """A conversation of 2 KB turns, `size` bytes in all, every turn different."""
    rng = random.Random(7)
    messages = []
    while sum(len(m["content"]) for m in messages) < size:
        text = " ".join(rng.choice(WORDS) for _ in range(330))[:2000]
        messages.append(
            {"role": "user" if len(messages) % 2 == 0 else "assistant", "content": text}
        )
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 8})


def test_a_400_kb_prompt_is_routed_and_its_chain_recorded():
    body = chat_body(400 * 1024)
    with Stack(StackOptions(upstreams=2)) as stack:
        r = httpx.post(
            f"{stack.url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=60,
        )
        assert r.status_code == 200
        served = r.json()["endpoint"]
        admin = f"http://127.0.0.1:{stack.picker_admin_port}"
        explain = httpx.post(
            f"{admin}/debug/explain",
            content=body,
            headers={"x-extproc-path": "/v1/chat/completions"},
            timeout=30,
        )
        assert explain.status_code == 200
        held = explain.json()["prefix_blocks"]
        # ~400 KB of canonical stream in 256-byte blocks: ~1,580 blocks, all on the server
        # that served it, none elsewhere.
        assert held.get(served, 0) >= 1500, held
        assert all(v == 0 for a, v in held.items() if a != served), held
