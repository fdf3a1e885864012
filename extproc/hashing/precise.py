"""Precise block keys over real token ids, shared by request hashing and KV-event ingestion.

Both sides must call `token_block_keys` with the same inputs to agree on a block's key:
the request side with the tokenized prompt, the KV-event side with `BlockStored.token_ids`.
Keys are our own (xxh3-64), not vLLM's engine hashes, which are not reproducible outside the
engine (seeded, pickle-based, adapter paths).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import xxhash

ExtraKey = str | int
"""One extra key of a block: a media identifier, a media offset, a cache salt, ..."""


def chain_seed(model: str, lora_adapter: str | None = None) -> int:
    """The parent key of block 0: separates models and LoRA adapters in one index."""
    h = xxhash.xxh3_64(b"extproc/precise/v1\0")
    h.update(model.encode())
    h.update(b"\0")
    if lora_adapter:
        h.update(lora_adapter.encode())
    return h.intdigest()


def token_block_keys(
    token_ids: Sequence[int],
    block_size: int,
    parent: int,
    extra_keys: Sequence[Sequence[ExtraKey] | None] | None = None,
) -> list[int]:
    """Chained keys of the full blocks of `token_ids` (a trailing partial block is ignored,
    as the engine only caches full blocks).

    key_i = xxh3_64(key_{i-1} | tokens of block i | extra keys of block i), with
    key_{-1} = `parent`. `extra_keys[i]` belongs to block i (None or empty: no extras).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    n_full = len(token_ids) // block_size
    keys: list[int] = []
    pack_tokens = struct.Struct(f"<{block_size}I").pack
    for i in range(n_full):
        h = xxhash.xxh3_64(parent.to_bytes(8, "little"))
        h.update(pack_tokens(*token_ids[i * block_size : (i + 1) * block_size]))
        extras = extra_keys[i] if extra_keys is not None and i < len(extra_keys) else None
        if extras:
            for extra in extras:
                h.update(b"\x1f")
                h.update(str(extra).encode())
        parent = h.intdigest()
        keys.append(parent)
    return keys
