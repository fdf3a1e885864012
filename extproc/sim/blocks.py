"""KV block identity in the simulator: vLLM-style chained engine hashes, the form they take
on the wire, and our own precise keys alongside (so tests can compare an index with the
truth without re-deriving anything).

engine_hash_i = sha256(msgpack([engine_hash_{i-1} or NONE_HASH, block tokens, extra keys]))
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from msgspec import msgpack

from extproc.hashing.precise import ExtraKey, chain_seed, token_block_keys

# vLLM derives NONE_HASH from a seed; any fixed value gives the same shape (and, like vLLM's
# sha256 family with PYTHONHASHSEED unset, the same hashes in every process).
NONE_HASH = hashlib.sha256(b"extproc-sim/none-hash").digest()

WireHash = int | bytes
"""A block hash as published: low 64 bits as an unsigned int (vLLM's default), or 32 bytes."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """One full block's identity: engine `hash` (32 bytes), its `parent` (None for block 0),
    the `token_ids` it holds, the `extra_keys` published with it (None when it has none) and
    `key`, extproc's precise key (`token_block_keys` with `chain_seed(model)`)."""

    hash: bytes
    parent: bytes | None
    token_ids: tuple[int, ...]
    extra_keys: tuple[ExtraKey, ...] | None
    key: int


def engine_hash(
    parent: bytes | None, token_ids: Sequence[int], extras: Sequence[ExtraKey] | None
) -> bytes:
    payload = msgpack.encode([parent or NONE_HASH, list(token_ids), list(extras or ()) or None])
    return hashlib.sha256(payload).digest()


def wire_hash(h: bytes, as_bytes: bool) -> WireHash:
    """What KV events carry for `h`: the raw digest, or its low 64 bits big-endian."""
    return h if as_bytes else int.from_bytes(h[-8:], "big")


def chain_blocks(
    token_ids: Sequence[int],
    block_size: int,
    model: str,
    extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
    start: int = 0,
) -> list[BlockInfo]:
    """The full blocks of `token_ids`, from block `start` on (the chain is always hashed
    from block 0: a few microseconds per block). A trailing partial block is left out."""
    keys = token_block_keys(token_ids, block_size, chain_seed(model), extra_keys)
    out: list[BlockInfo] = []
    prev: bytes | None = None
    for i in range(len(keys)):
        tokens = tuple(token_ids[i * block_size : (i + 1) * block_size])
        extras = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        extras_t = tuple(extras) if extras else None
        h = engine_hash(prev, tokens, extras_t)
        if i >= start:
            out.append(BlockInfo(h, prev, tokens, extras_t, keys[i]))
        prev = h
    return out
