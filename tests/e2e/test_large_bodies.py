"""400 KB and 4 MB prompts through Envoy and `extproc serve`: routed, and their chains of
block keys recorded in the index (the bulk write path), so the same prompt matches in full
next."""

from __future__ import annotations

import random
from collections.abc import Iterator

import httpx
import orjson
import pytest

from extproc.stack import Stack, StackOptions


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    """One picker behind Envoy for both sizes (their conversations differ from turn one)."""
    with Stack(StackOptions(upstreams=2)) as s:
        yield s


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


def chat_body(size: int, seed: int = 7) -> bytes:
    """A conversation of 2 KB turns, `size` bytes in all, every turn different."""
    rng = random.Random(seed)
    messages = []
    while sum(len(m["content"]) for m in messages) < size:
        text = " ".join(rng.choice(WORDS) for _ in range(330))[:2000]
        messages.append(
            {"role": "user" if len(messages) % 2 == 0 else "assistant", "content": text}
        )
    return orjson.dumps({"model": "m", "messages": messages, "max_tokens": 8})


def test_a_400_kb_prompt_is_routed_and_its_chain_recorded(stack: Stack) -> None:
    body = chat_body(400 * 1024)
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


def test_a_4_mb_prompt_is_routed_and_its_capped_chain_recorded(stack: Stack) -> None:
    """~1M tokens: the body streams through the picker in many chunks, is parsed whole (the
    token estimate counts all of it) and keyed up to the block cap; the chain is recorded on
    the server that served it. (Where the second copy goes is the profile's call: with ~1M
    tokens to prefill, 512 KB of cached prefix weighs little against load.)"""
    body = chat_body(4 * 1024 * 1024, seed=8)
    served = []
    for _ in range(2):
        r = httpx.post(
            f"{stack.url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
            timeout=120,
        )
        assert r.status_code == 200
        served.append(r.json()["endpoint"])
    # Explain takes at most 4 MiB: ask about the conversation's first 300 turns (~600
    # KB), whose stream starts with the same 512 KB.
    head = orjson.loads(body)
    head["messages"] = head["messages"][:300]
    admin = f"http://127.0.0.1:{stack.picker_admin_port}"
    explain = httpx.post(
        f"{admin}/debug/explain",
        content=orjson.dumps(head),
        headers={"x-extproc-path": "/v1/chat/completions"},
        timeout=60,
    )
    assert explain.status_code == 200
    held = explain.json()["prefix_blocks"]
    # The default cap: 2,048 blocks of 256 bytes (512 KB of the 4 MB stream), held where
    # it was served and nowhere else.
    assert held.get(served[-1], 0) == 2048, held
    assert all(v == 0 for a, v in held.items() if a not in served), held
