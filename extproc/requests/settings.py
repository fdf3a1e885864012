"""`ParseSettings`: every knob of request parsing and approximate hashing, with defaults that
work untouched (`ParseSettings()`). Decoded strictly from config like the rest of Settings.
"""

from __future__ import annotations

import fnmatch
from typing import Annotated

import msgspec

from extproc.hashing.estimate import (
    DEFAULT_IMAGE_ESTIMATORS,
    AudioEstimator,
    ImageEstimator,
    ModelImageEstimator,
    VideoEstimator,
)
from extproc.hashing.tokenizer import PreciseSettings

_Positive = Annotated[int, msgspec.Meta(gt=0)]


class ParseSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How request bodies become block keys and token estimates.

    - `block_tokens` (64) x `bytes_per_token` (4): approximate blocks of 256 canonical bytes.
      A media item weighs `tokens * bytes_per_token` bytes, so an image blocks like its cost.
      `key_bytes_per_token`, when set, replaces `bytes_per_token` in both (the key geometry)
      while token estimates keep using `bytes_per_token`: see the field.
    - `max_blocks` (2048): blocks hashed per request, 512 KB of stream, ~128k tokens. Token
      estimates still cover the whole prompt.
    - `image_estimators`: first `model_glob` match wins (Qwen3-VL 1024 px/token, Qwen2-VL
      784, LLaVA 576 fixed, Gemma 280 fixed); else `default_image_estimator` (dynamic 784).
    - `url_image_width` x `url_image_height` (1280x720): resolution that prices image URLs
      and inline images of formats we cannot sniff; URLs are never fetched.
    - `video`, `audio`: see their estimators.
    - `adapters`: LoRA adapter name -> base model; a request naming an adapter sets
      `lora_adapter`, which feeds the block-key seed.
    - `message_overhead_tokens` (4): template tokens per chat turn (role markers).
    - `precise` (None): tokenizer + chat template for precise block keys. `parse_request`
      computes approximate keys unless told not to (`approximate_keys=False`); whoever owns
      startup builds `PreciseKeys.from_settings(precise)` once and calls
      `.block_keys(request)` on the parsed request.
    """

    block_tokens: _Positive = 64
    bytes_per_token: _Positive = 4
    max_blocks: _Positive = 2048
    image_estimators: tuple[ModelImageEstimator, ...] = DEFAULT_IMAGE_ESTIMATORS
    default_image_estimator: ImageEstimator = ImageEstimator()
    url_image_width: _Positive = 1280
    url_image_height: _Positive = 720
    video: VideoEstimator = VideoEstimator()
    audio: AudioEstimator = AudioEstimator()
    adapters: dict[str, str] = msgspec.field(default_factory=dict)
    message_overhead_tokens: Annotated[int, msgspec.Meta(ge=0)] = 4
    precise: PreciseSettings | None = None
    # Approximate keys follow the engines: `block_tokens` from their reported KV block size,
    # `bytes_per_token` from their prompt-token counts (extproc/calibration.py).
    calibrate: bool = True
    # Bytes per token of the key geometry (block bytes, media placeholder width); None means
    # `bytes_per_token`. Calibration pins it to the value the keys were made with before it
    # first changes `bytes_per_token`: a better token estimate then never moves a block
    # boundary, so every prefix recorded before the change still matches after it.
    key_bytes_per_token: _Positive | None = None

    @property
    def key_bpt(self) -> int:
        return self.key_bytes_per_token or self.bytes_per_token

    @property
    def block_bytes(self) -> int:
        return self.block_tokens * self.key_bpt

    @property
    def key_block_tokens(self) -> int:
        """Estimated tokens one approximate block covers: `block_tokens` until calibration
        changes `bytes_per_token` under a pinned key geometry, then scaled by the change."""
        if self.key_bytes_per_token is None:
            return self.block_tokens  # read once per request: skip the float round trip
        return max(1, round(self.block_bytes / self.bytes_per_token))

    def image_estimator(self, model: str) -> ImageEstimator:
        """The estimator for `model` (first glob match, case-blind)."""
        lowered = model.lower()
        for rule in self.image_estimators:
            if fnmatch.fnmatchcase(lowered, rule.model_glob.lower()):
                return rule.estimator
        return self.default_image_estimator
