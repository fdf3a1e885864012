"""Media facts from header bytes only: image width/height (PNG, JPEG, GIF, WebP, BMP) and
WAV duration. Nothing is ever decoded in full; every read is bounds-checked.

`InvalidMedia` means the bytes claim a known format but the header is truncated or absurd;
the caller turns it into a 400 naming the field. An unrecognised format is not an error
(the caller prices it at a default), since model servers accept more formats than we sniff.
"""

from __future__ import annotations

import struct

MAX_IMAGE_PIXELS = 178_956_970
"""Largest believable image (w*h); past it a header is lying (e.g. 100000x100000)."""

_JPEG_MAX_SEGMENTS = 1024  # real files reach their SOF within ~30 segments
_JPEG_SOF = frozenset(
    (0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF)
)
_JPEG_STANDALONE = frozenset((0x01, *range(0xD0, 0xD8)))


class InvalidMedia(ValueError):
    """A known media format with a truncated or impossible header."""


def image_size(data: bytes) -> tuple[int, int] | None:
    """(width, height) from the header of an image, or None for an unrecognised format."""
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        size = _png(data)
    elif data[:3] == b"\xff\xd8\xff":
        size = _jpeg(data)
    elif data[:6] in (b"GIF87a", b"GIF89a"):
        _need(data, 10)
        size = struct.unpack_from("<HH", data, 6)
    elif data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        size = _webp(data)
    elif data[:2] == b"BM" and len(data) >= 14:
        size = _bmp(data)
    else:
        return None
    width, height = size
    if width <= 0 or height <= 0 or width * height > MAX_IMAGE_PIXELS:
        raise InvalidMedia("image dimensions out of range")
    return width, height


def _need(data: bytes, n: int) -> None:
    if len(data) < n:
        raise InvalidMedia("truncated image header")


def _png(data: bytes) -> tuple[int, int]:
    _need(data, 24)
    if data[12:16] != b"IHDR":
        raise InvalidMedia("PNG without IHDR")
    return struct.unpack_from(">II", data, 16)


def _jpeg(data: bytes) -> tuple[int, int]:
    i, n = 2, len(data)
    for _ in range(_JPEG_MAX_SEGMENTS):
        if i + 4 > n:
            break
        if data[i] != 0xFF:
            raise InvalidMedia("corrupt JPEG segment")
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _JPEG_STANDALONE:
            i += 2
            continue
        if marker in (0xD8, 0xD9, 0xDA):
            raise InvalidMedia("JPEG without a frame header")
        (length,) = struct.unpack_from(">H", data, i + 2)
        if length < 2:
            raise InvalidMedia("corrupt JPEG segment")
        if marker in _JPEG_SOF:
            _need(data, i + 9)
            height, width = struct.unpack_from(">HH", data, i + 5)
            return width, height
        i += 2 + length
    raise InvalidMedia("truncated JPEG header")


def _webp(data: bytes) -> tuple[int, int]:
    _need(data, 30)
    chunk = data[12:16]
    if chunk == b"VP8 ":
        if data[23:26] != b"\x9d\x01\x2a":
            raise InvalidMedia("corrupt WebP frame")
        w, h = struct.unpack_from("<HH", data, 26)
        return w & 0x3FFF, h & 0x3FFF
    if chunk == b"VP8L":
        if data[20] != 0x2F:
            raise InvalidMedia("corrupt WebP frame")
        (bits,) = struct.unpack_from("<I", data, 21)
        return (bits & 0x3FFF) + 1, ((bits >> 14) & 0x3FFF) + 1
    if chunk == b"VP8X":
        w = int.from_bytes(data[24:27], "little") + 1
        h = int.from_bytes(data[27:30], "little") + 1
        return w, h
    raise InvalidMedia("unknown WebP chunk")


def _bmp(data: bytes) -> tuple[int, int]:
    _need(data, 26)
    (header_size,) = struct.unpack_from("<I", data, 14)
    if header_size == 12:  # OS/2 BITMAPCOREHEADER
        return struct.unpack_from("<HH", data, 18)
    w, h = struct.unpack_from("<ii", data, 18)
    return w, abs(h)  # negative height: rows stored top-down


def wav_duration_s(data: bytes) -> float | None:
    """Duration of a RIFF/WAVE clip from its `fmt ` byte rate and `data` chunk size, or None
    when `data` is not WAV. Walks at most 64 chunks."""
    if data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    i, n, byte_rate = 12, len(data), 0
    for _ in range(64):
        if i + 8 > n:
            break
        chunk = data[i : i + 4]
        (size,) = struct.unpack_from("<I", data, i + 4)
        if chunk == b"fmt ":
            if i + 20 > n:
                break
            (byte_rate,) = struct.unpack_from("<I", data, i + 16)
        elif chunk == b"data":
            if byte_rate <= 0:
                raise InvalidMedia("WAV data before a valid fmt chunk")
            # Streamed WAVs write a 0 or 0xFFFFFFFF size: trust the bytes actually present.
            available = n - i - 8
            if size == 0 or size > available:
                size = available
            return size / byte_rate
        i += 8 + size + (size & 1)
    raise InvalidMedia("truncated WAV header")
