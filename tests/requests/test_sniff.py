"""Dimensions and durations from header bytes only."""

from __future__ import annotations

import struct

import pytest

from extproc.requests.sniff import InvalidMedia, image_size, wav_duration_s
from tests.requests import images


@pytest.mark.parametrize(
    "build",
    [
        images.png,
        images.jpeg,
        images.gif,
        images.webp_vp8x,
        images.webp_vp8l,
        images.webp_vp8,
        images.bmp,
    ],
)
def test_each_format_reports_width_and_height(build) -> None:
    assert image_size(build(1280, 720)) == (1280, 720)


def test_bmp_stored_top_down_has_positive_height() -> None:
    assert image_size(images.bmp(64, -32)) == (64, 32)


def test_jpeg_skips_fill_bytes_and_app_segments() -> None:
    data = images.jpeg(300, 200)
    padded = data[:2] + b"\xff\xe1\x00\x10" + bytes(14) + b"\xff" + data[2:]
    assert image_size(padded) == (300, 200)


def test_unknown_format_is_not_an_error() -> None:
    assert image_size(b"\x00\x00\x01\x00 not an image") is None
    assert image_size(b"") is None


@pytest.mark.parametrize(
    "data",
    [
        images.png(10, 10)[:20],
        images.jpeg(10, 10)[:12],
        b"\xff\xd8\xff\xda\x00\x02",
        images.gif(10, 10)[:8],
        images.webp_vp8x(10, 10)[:26],
        images.bmp(10, 10)[:20],
    ],
    ids=["png", "jpeg", "jpeg-no-sof", "gif", "webp", "bmp"],
)
def test_truncated_headers_are_invalid(data: bytes) -> None:
    with pytest.raises(InvalidMedia):
        image_size(data)


@pytest.mark.parametrize("w,h", [(100_000, 100_000), (0, 10), (10, 0)])
def test_lying_dimensions_are_invalid(w: int, h: int) -> None:
    with pytest.raises(InvalidMedia, match="out of range"):
        image_size(images.png(w, h))


def test_jpeg_with_endless_segments_gives_up_quickly() -> None:
    data = b"\xff\xd8" + b"\xff\xe1\x00\x02" * 100_000
    with pytest.raises(InvalidMedia):
        image_size(data)


def test_wav_duration_from_byte_rate_and_data_size() -> None:
    assert wav_duration_s(images.wav(2.5)) == pytest.approx(2.5)
    assert wav_duration_s(images.wav(1.0, rate=44100, channels=2)) == pytest.approx(1.0)


def test_streamed_wav_with_unknown_size_uses_the_bytes_present() -> None:
    data = bytearray(images.wav(1.0))
    data[40:44] = struct.pack("<I", 0xFFFFFFFF)
    assert wav_duration_s(bytes(data)) == pytest.approx(1.0)


def test_wav_without_fmt_is_invalid_and_non_wav_is_none() -> None:
    with pytest.raises(InvalidMedia):
        wav_duration_s(b"RIFF\x00\x00\x00\x00WAVEdata\x04\x00\x00\x00abcd")
    assert wav_duration_s(b"ID3 mp3 bytes") is None
