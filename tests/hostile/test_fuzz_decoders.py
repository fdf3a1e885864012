"""Every decoder of foreign bytes answers with a value or its own documented error: KV-event
batches, image and audio headers. Fixed hypothesis budgets here; bench/fuzz.py runs longer."""

from __future__ import annotations

import msgpack
import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from extproc.index.kvevents import decode_batch
from extproc.requests.sniff import InvalidMedia, image_size, wav_duration_s

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=True),
    st.binary(max_size=40),
    st.text(max_size=20),
)
values = st.recursive(
    scalars,
    lambda inner: (
        st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=12), inner, max_size=6)
    ),
    max_leaves=30,
)
event_maps = st.fixed_dictionaries(
    {"type": st.sampled_from(["BlockStored", "BlockRemoved", "AllBlocksCleared", "Other", 3])},
    optional={
        "block_hashes": st.lists(
            st.one_of(st.integers(0, 2**64 - 1), st.binary(max_size=33)), max_size=4
        ),
        "parent_block_hash": st.one_of(
            st.none(), st.integers(0, 2**64 - 1), st.binary(max_size=32)
        ),
        "token_ids": st.lists(st.integers(-5, 2**33), max_size=70),
        "block_size": st.integers(-1, 64),
        "medium": st.one_of(st.none(), st.text(max_size=5)),
        "lora_name": st.one_of(st.none(), st.text(max_size=5)),
        "extra_keys": values,
        "group_idx": st.one_of(st.none(), st.integers(-1, 3)),
    },
)
events = st.one_of(event_maps, st.lists(values, max_size=12), values)


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_decode_to_events_or_a_decode_error(payload: bytes) -> None:
    try:
        out, skipped = decode_batch(payload)
    except msgspec.DecodeError:
        return
    assert skipped >= 0
    assert isinstance(out, list)


@FUZZ
@given(
    st.floats(allow_nan=True),
    st.lists(events, max_size=6),
    st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
)
def test_any_msgpack_batch_decodes_to_events_or_a_decode_error(ts, evs, rank) -> None:
    payload = msgpack.packb([ts, evs, rank], use_bin_type=True)
    try:
        out, skipped = decode_batch(payload)
    except msgspec.DecodeError:
        return
    assert len(out) + skipped == len(evs)


headers = st.sampled_from(
    [b"\x89PNG\r\n\x1a\n", b"\xff\xd8\xff", b"GIF89a", b"RIFF\x00\x00\x00\x00WEBP", b"BM", b"RIFF"]
)


@FUZZ
@given(headers, st.binary(max_size=200))
def test_any_image_header_gives_a_size_none_or_invalid_media(magic: bytes, rest: bytes) -> None:
    try:
        size = image_size(magic + rest)
    except InvalidMedia:
        return
    if size is not None:
        w, h = size
        assert w > 0 and h > 0


@FUZZ
@given(st.binary(max_size=200))
def test_any_bytes_give_a_wav_duration_none_or_invalid_media(data: bytes) -> None:
    try:
        d = wav_duration_s(b"RIFF" + data)
    except InvalidMedia:
        return
    assert d is None or d >= 0
