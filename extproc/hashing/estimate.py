"""Token-cost estimates: text from its length, images from their resolution, video from its
duration and frame sampling, audio from its duration. Pure arithmetic, no decoding.

Cost depends on the model family, not on the bytes on the wire (FACTS §7): a 1280x720 image
is ~900 tokens for Qwen3-VL whether it arrives as a 90 KB JPEG or a 2 MB PNG.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

import msgspec

_Positive = Annotated[int, msgspec.Meta(gt=0)]
_NonNegative = Annotated[int, msgspec.Meta(ge=0)]
_PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]

BYTES_PER_TOKEN = 4
"""Average UTF-8 bytes of English text per token; also the width of one placeholder unit."""


def text_tokens(text: str, bytes_per_token: int = BYTES_PER_TOKEN) -> int:
    """Estimated tokens of `text`: ASCII at `bytes_per_token` characters a token; each
    non-ASCII character counts about one token (CJK scripts tokenize near one character per
    token), guessed from the extra UTF-8 bytes so that no per-character Python loop runs."""
    n = len(text)
    if text.isascii():  # O(1) in CPython: the string's kind flag
        return -(-n // bytes_per_token)
    extra = len(text.encode("utf-8", "surrogatepass")) - n
    non_ascii = min(n, -(-extra // 2))
    return -(-(n - non_ascii) // bytes_per_token) + non_ascii


class ImageEstimator(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How many tokens one image costs for a model family.

    `kind: dynamic` (Qwen-VL style): `ceil(clamp(w*h, min_pixels, max_pixels) /
    pixels_per_token)`; 784 = 28x28 for Qwen2/2.5-VL, 1024 = 32x32 for Qwen3-VL.
    `kind: fixed` (LLaVA-1.5 576, Gemma budgets 70/140/280/560/1120): `tokens` per image,
    whatever its size.
    """

    kind: Literal["dynamic", "fixed"] = "dynamic"
    pixels_per_token: _Positive = 784
    min_pixels: _NonNegative = 3136
    max_pixels: _Positive = 12_845_056
    tokens: _NonNegative = 576

    def image_tokens(self, width: int, height: int) -> int:
        if self.kind == "fixed":
            return self.tokens
        pixels = min(max(width * height, self.min_pixels), self.max_pixels)
        return -(-pixels // self.pixels_per_token)


class ModelImageEstimator(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Applies `estimator` to models whose name matches `model_glob` (fnmatch, case-blind)."""

    model_glob: str
    estimator: ImageEstimator


DEFAULT_IMAGE_ESTIMATORS: tuple[ModelImageEstimator, ...] = (
    ModelImageEstimator(
        "*qwen3*vl*",
        ImageEstimator(pixels_per_token=1024, min_pixels=65_536, max_pixels=16_777_216),
    ),
    ModelImageEstimator("*qwen2*vl*", ImageEstimator(pixels_per_token=784)),
    ModelImageEstimator("*llava*", ImageEstimator(kind="fixed", tokens=576)),
    ModelImageEstimator("*gemma*", ImageEstimator(kind="fixed", tokens=280)),
)


class VideoEstimator(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tokens of one video: `min(frames * tokens_per_frame, max_tokens)`.

    `frames: sampled` takes `ceil(min(duration_s * sample_fps, max_frames) / temporal_patch)`
    frames (Qwen-VL merges pairs of frames); `frames: strided` takes every `stride`-th source
    frame, `ceil(duration_s * source_fps / stride)`, capped at `max_frames`. A frame costs what
    an image of the video's resolution costs. Duration, source fps and resolution come from
    the `x-llm-d-video-*` headers when present, else from the defaults here (URLs are never
    fetched, inline video is not demuxed).
    """

    frames: Literal["sampled", "strided"] = "sampled"
    sample_fps: _PositiveFloat = 2.0
    temporal_patch: _Positive = 2
    stride: _Positive = 15
    max_frames: _Positive = 768
    max_tokens: _Positive = 16_384
    default_fps: _PositiveFloat = 30.0
    default_duration_s: _PositiveFloat = 10.0
    default_width: _Positive = 640
    default_height: _Positive = 360

    def video_tokens(self, tokens_per_frame: int, duration_s: float, source_fps: float) -> int:
        if self.frames == "sampled":
            sampled = min(math.ceil(duration_s * self.sample_fps), self.max_frames)
            frames = -(-sampled // self.temporal_patch)
        else:
            frames = min(math.ceil(duration_s * source_fps / self.stride), self.max_frames)
        return min(max(frames, 1) * tokens_per_frame, self.max_tokens)


class AudioEstimator(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Tokens of one audio clip: `ceil(duration_s * tokens_per_s)`, capped at `max_tokens`.

    Duration comes from a WAV header when there is one; other inline formats are priced at
    `fallback_bytes_per_s` (16000 = 128 kbit/s MP3); audio URLs at `default_duration_s`.
    Whisper-style encoders (Qwen2-Audio) emit 25 tokens per second.
    """

    tokens_per_s: _PositiveFloat = 25.0
    fallback_bytes_per_s: _Positive = 16_000
    default_duration_s: _PositiveFloat = 30.0
    max_tokens: _Positive = 30_000

    def audio_tokens(self, duration_s: float) -> int:
        return min(max(math.ceil(duration_s * self.tokens_per_s), 1), self.max_tokens)
