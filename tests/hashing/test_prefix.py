"""The approximate block chain and the canonical stream."""

from __future__ import annotations

import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from extproc.core import MediaItem, Message, Modality, Part, Prompt
from extproc.hashing.prefix import approx_seed, block_keys, canonical_stream, placeholder

LIMIT = 1 << 20


def test_chain_is_xxh3_seeded_by_the_parent() -> None:
    stream = bytes(range(256)) * 3
    keys = block_keys(stream, 256, 42)
    k0 = xxhash.xxh3_64_intdigest(stream[:256], 42)
    assert keys[:2] == (k0, xxhash.xxh3_64_intdigest(stream[256:512], k0))
    assert len(keys) == 3


def test_partial_trailing_block_has_no_key() -> None:
    assert block_keys(b"x" * 511, 256, 0) == block_keys(b"x" * 256, 256, 0)
    assert block_keys(b"x" * 255, 256, 0) == ()


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=64, max_size=600), st.binary(max_size=200), st.integers(0, 2**64 - 1))
def test_extending_a_stream_keeps_its_keys(head: bytes, tail: bytes, seed: int) -> None:
    a, b = block_keys(head, 16, seed), block_keys(head + tail, 16, seed)
    assert b[: len(a)] == a


@settings(max_examples=200, deadline=None)
@given(st.binary(min_size=64, max_size=600), st.data())
def test_a_changed_byte_changes_its_block_and_all_later_keys(stream: bytes, data) -> None:
    i = data.draw(st.integers(0, len(stream) - 1))
    changed = stream[:i] + bytes([stream[i] ^ 1]) + stream[i + 1 :]
    a, b = block_keys(stream, 16, 7), block_keys(changed, 16, 7)
    first = i // 16
    assert a[:first] == b[:first]
    assert all(x != y for x, y in zip(a[first:], b[first:], strict=True))


def test_seed_separates_models_adapters_and_salts() -> None:
    seeds = {
        approx_seed("m"),
        approx_seed("m", "lora"),
        approx_seed("m", None, "salt"),
        approx_seed("m2"),
        approx_seed("m", "lora", "salt"),
    }
    assert len(seeds) == 5
    assert approx_seed("m", "", "") == approx_seed("m")


def _chat(*texts: str, role: str = "user") -> Prompt:
    return Prompt(messages=tuple(Message(role, (Part(t),)) for t in texts))


def test_role_markers_cannot_be_forged_by_text() -> None:
    a = canonical_stream(_chat("hi", role="user"), 4, LIMIT)
    b = canonical_stream(_chat("hi", role="assistant"), 4, LIMIT)
    assert a != b
    assert b"\xff" not in "any text \u00ff\u4e2d".encode()  # markers are invalid UTF-8


def test_media_enters_as_a_placeholder_run_of_its_token_cost() -> None:
    item = MediaItem(Modality.IMAGE, "ab" * 32, tokens=100)
    prompt = Prompt(messages=(Message("user", (Part("look"), Part(media=item))),))
    stream = canonical_stream(prompt, 4, LIMIT)
    run = placeholder(bytes.fromhex(item.content_hash), 100, 4)
    assert len(run) == 400 and stream.endswith(run)


def test_tools_come_first_and_completions_have_no_role_marker() -> None:
    prompt = Prompt(tools=(b'{"name":"f"}',), messages=_chat("hi").messages)
    assert canonical_stream(prompt, 4, LIMIT).startswith(b'\xff\x01{"name":"f"}')
    assert canonical_stream(Prompt(completion="plain"), 4, LIMIT) == b"plain"
    ids = canonical_stream(Prompt(completion=(1, 2)), 4, LIMIT)
    assert ids == b"\xff\x07\x01\x00\x00\x00\x02\x00\x00\x00"


def test_stream_is_cut_at_the_limit_without_encoding_everything() -> None:
    prompt = _chat("a" * 10_000_000, "b")
    assert canonical_stream(prompt, 4, 1000) == canonical_stream(_chat("a" * 10_000_000), 4, 1000)
    assert len(canonical_stream(prompt, 4, 1000)) == 1000


def test_text_parts_are_joined_like_the_engine_joins_them() -> None:
    split = Prompt(messages=(Message("user", (Part("ab"), Part("c"))),))
    joined = Prompt(messages=(Message("user", (Part("ab\nc"),)),))
    assert canonical_stream(split, 4, LIMIT) == canonical_stream(joined, 4, LIMIT)
