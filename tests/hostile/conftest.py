"""The hostile tests' picker: routing only (its endpoints are never contacted), a 200 KB body
limit, served from a background thread so synchronous (hypothesis) tests can drive it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from extproc.config import ServerSettings, Settings, StateSettings
from extproc.testing import ThreadedPicker, picker_in_thread

ENDPOINTS = ("127.0.0.11:8000", "127.0.0.12:8000")


def hostile_settings() -> Settings:
    return Settings(
        endpoints=list(ENDPOINTS),
        state=StateSettings(scrape=None),
        server=ServerSettings(
            host="127.0.0.1",
            port=0,
            health_port=0,
            admin_port=None,
            grace_s=0.5,
            response_grace_s=0.5,  # hostile streams left open must not hold the teardown
            drain_delay_s=0,
            max_body_bytes=200_000,
            plaintext=True,
        ),
    )


@pytest.fixture(scope="module")
def picker() -> Iterator[ThreadedPicker]:
    with picker_in_thread(hostile_settings()) as p:
        yield p
