"""Token-cost estimators: the formulas and their documented defaults."""

from __future__ import annotations

import pytest

from extproc.hashing.estimate import AudioEstimator, ImageEstimator, VideoEstimator, text_tokens
from extproc.requests import ParseSettings


def test_text_ascii_at_four_characters_a_token() -> None:
    assert [text_tokens(s) for s in ("", "a", "abcd", "abcde")] == [0, 1, 1, 2]


def test_text_cjk_near_one_token_a_character() -> None:
    assert text_tokens("\u4e2d" * 100) == 100
    assert 25 <= text_tokens("caf\u00e9 " * 20) <= 40


@pytest.mark.parametrize(
    "estimator,w,h,tokens",
    [
        (ImageEstimator(pixels_per_token=784), 1280, 720, 1176),
        (
            ImageEstimator(pixels_per_token=1024, min_pixels=65_536, max_pixels=16_777_216),
            1280,
            720,
            900,
        ),
        (ImageEstimator(pixels_per_token=784), 10, 10, 4),  # min_pixels 3136 clamp
        (ImageEstimator(pixels_per_token=784), 8000, 8000, 16384),  # max_pixels clamp
        (ImageEstimator(kind="fixed", tokens=576), 4000, 3000, 576),
    ],
)
def test_image_estimators(estimator: ImageEstimator, w: int, h: int, tokens: int) -> None:
    assert estimator.image_tokens(w, h) == tokens


def test_model_globs_pick_the_family_and_fall_back_to_default() -> None:
    s = ParseSettings()
    assert s.image_estimator("Qwen/Qwen3-VL-30B").pixels_per_token == 1024
    assert s.image_estimator("Qwen/Qwen2.5-VL-7B-Instruct").pixels_per_token == 784
    assert s.image_estimator("google/gemma-3-4b-it").tokens == 280
    assert s.image_estimator("some-model") == s.default_image_estimator


def test_video_sampled_strided_and_capped() -> None:
    sampled = VideoEstimator()
    assert sampled.video_tokens(100, duration_s=10, source_fps=30) == 1000  # 20 frames / 2
    assert sampled.video_tokens(100, duration_s=10_000, source_fps=30) == 16_384
    strided = VideoEstimator(frames="strided", stride=15)
    assert strided.video_tokens(100, duration_s=10, source_fps=30) == 2000  # 300 / 15 frames


def test_audio_per_second_with_cap() -> None:
    audio = AudioEstimator()
    assert audio.audio_tokens(4.0) == 100
    assert audio.audio_tokens(0.0) == 1
    assert audio.audio_tokens(1e9) == 30_000
