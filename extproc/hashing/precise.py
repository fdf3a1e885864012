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
    # One pack for all blocks, then zero-copy slices: the same bytes as packing per block.
    width = 4 * block_size
    packed = memoryview(struct.pack(f"<{n_full * block_size}I", *token_ids[: n_full * block_size]))
    n_extra = len(extra_keys) if extra_keys is not None else 0
    for i in range(n_full):
        block = packed[i * width : (i + 1) * width]
        extras = extra_keys[i] if i < n_extra else None  # type: ignore[index]
        if extras:
            tail = b"".join(b"\x1f" + str(extra).encode() for extra in extras)
            parent = xxhash.xxh3_64_intdigest(b"".join((parent.to_bytes(8, "little"), block, tail)))
        else:
            parent = xxhash.xxh3_64_intdigest(b"".join((parent.to_bytes(8, "little"), block)))
        keys.append(parent)
    return keys


def block_extra_keys(
    n_blocks: int,
    block_size: int,
    media: Sequence[tuple[str, int, int]] = (),
    cache_salt: str | None = None,
) -> list[list[ExtraKey]] | None:
    """Per-block extra keys in the shape vLLM publishes in `BlockStored.extra_keys`: for each
    media item `(identifier, start, length)` overlapping block i, its identifier and its
    offset relative to the block start; then the cache salt, in block 0 only. None when no
    block has extras (the common text case)."""
    if not media and not cache_salt:
        return None
    extras: list[list[ExtraKey]] = [[] for _ in range(n_blocks)]
    for identifier, start, length in media:
        first = start // block_size
        last = min((start + length - 1) // block_size, n_blocks - 1)
        for b in range(first, last + 1):
            extras[b] += [identifier, start - b * block_size]
    if cache_salt and n_blocks:
        extras[0].append(cache_salt)
    return extras
