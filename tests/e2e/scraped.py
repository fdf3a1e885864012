"""Waiting for the picker's view of an endpoint to include a scrape taken after a moment:
what tests that read the engine's counts of a running request need before they ask."""

from __future__ import annotations

import time
from collections.abc import Callable


def scrape_since(state: Callable[[], dict], since: float, *, timeout_s: float = 30.0) -> dict:
    """Polls `state()` (an endpoint's row of the picker's /debug/state, with `age_s`, the
    age of its last scrape) until that scrape was taken after `since` (time.monotonic())
    and returns that row; fails with the last row after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        st = state()
        age = st["age_s"]
        if age is not None and time.monotonic() - age > since + 0.01:
            return st
        assert time.monotonic() < deadline, st
        time.sleep(0.02)
