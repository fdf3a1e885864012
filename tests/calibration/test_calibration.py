"""Approximate keys follow what the engines report: block size, and characters per token
from their prompt-token counters."""

from __future__ import annotations

import orjson

from extproc.calibration import Calibration
from extproc.requests.settings import ParseSettings

BODY = orjson.dumps({"model": "m", "prompt": "x" * 4000})


def test_block_size_follows_the_engine_and_changes_the_keys() -> None:
    cal = Calibration(ParseSettings())
    before = cal("/v1/completions", {}, BODY)
    assert before.block_tokens == 64 and len(before.block_keys) == 4000 // 256
    cal.observe("a:1", 32, None)
    after = cal("/v1/completions", {}, BODY)
    assert after.block_tokens == 32 and len(after.block_keys) == 4000 // 128
    assert cal.stats.changes == 1 and cal.stats.block_tokens == 32
    cal.observe("a:1", 32, None)
    assert cal.stats.changes == 1  # the same size again changes nothing


def test_characters_per_token_follow_the_engines_counts() -> None:
    cal = Calibration(ParseSettings(bytes_per_token=4))
    req = cal("/v1/completions", {}, BODY)  # 1000 estimated tokens
    cal.observe("a:1", None, 10_000)  # opens the window
    for _ in range(4):
        cal.placed("a:1", req)
    cal.observe("a:1", None, 11_000)  # too few tokens yet to judge
    assert cal.stats.changes == 0
    cal.observe("a:1", None, 12_500)  # the engine counted 2500 for our 4000: 6.4 chars/token
    assert cal.settings.bytes_per_token == 6 and cal.stats.changes == 1
    assert cal("/v1/completions", {}, BODY).prompt_tokens == 667


def test_foreign_traffic_and_restarts_do_not_calibrate() -> None:
    cal = Calibration(ParseSettings(bytes_per_token=4))
    req = cal("/v1/completions", {}, BODY)
    cal.observe("a:1", None, 0)
    cal.placed("a:1", req)
    cal.observe("a:1", None, 50_000)  # 50x what we placed: someone else's requests
    assert cal.stats.windows_skipped == 1 and cal.settings.bytes_per_token == 4
    cal.observe("a:1", None, 10)  # the counter went back: a new engine, a new window
    cal.placed("a:1", req)
    cal.placed("a:1", req)
    cal.observe("a:1", None, 2010)
    assert cal.settings.bytes_per_token == 4 and cal.stats.ratios["a:1"] == 1.0


def test_disabled_calibration_never_changes_the_settings() -> None:
    cal = Calibration(ParseSettings(), enabled=False)
    cal.observe("a:1", 16, 0)
    assert cal.settings == ParseSettings() and cal.stats.changes == 0
