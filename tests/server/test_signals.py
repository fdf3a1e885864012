"""Which live signals feed scheduling is said at startup, exported as a metric and shown by
/debug/state: a picker routing on less than it was configured for cannot go unnoticed."""

from __future__ import annotations

import logging

import httpx
import msgspec
import pytest

from extproc.config import Settings, StateSettings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App


async def signals_seen(app: App) -> tuple[dict, str]:
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{app.admin_port}") as http:
        state = (await http.get("/debug/state")).json()
        metrics = (await http.get("/metrics")).text
    return state["signals"], metrics


async def test_default_picker_says_it_scrapes_and_learns_from_its_decisions(
    settings: Settings, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="extproc.signals")
    async with App(settings, parse_endpoints(",".join(settings.endpoints))) as app:
        signals, metrics = await signals_seen(app)
    assert signals == {
        "scraped-metrics": True,
        "in-flight": True,
        "kv-events": False,
        "approximate-index": True,
    }
    assert 'extproc_scheduling_signal{signal="scraped-metrics"} 1.0' in metrics
    assert 'extproc_scheduling_signal{signal="kv-events"} 0.0' in metrics
    # The KV-capacity model (approximate index) reports what it measured and how.
    assert "extproc_capacity_token_ratio 1.0" in metrics
    assert [r.getMessage() for r in caplog.records if r.name == "extproc.signals"] == [
        "scheduling signals: scraped-metrics, in-flight, approximate-index"
    ]


async def test_without_scraping_the_fall_back_to_in_flight_counts_is_loud(
    settings: Settings, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="extproc.signals")
    s = msgspec.structs.replace(settings, state=StateSettings(scrape=None))
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        signals, metrics = await signals_seen(app)
    assert signals["scraped-metrics"] is False
    assert 'extproc_scheduling_signal{signal="scraped-metrics"} 0.0' in metrics
    warned = [
        r.getMessage()
        for r in caplog.records
        if r.name == "extproc.signals" and r.levelno == logging.WARNING
    ]
    assert warned and "in-flight counts only" in warned[0]


async def test_sharing_asked_for_without_a_redis_index_is_said(
    settings: Settings, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.WARNING)
    s = msgspec.structs.replace(
        settings,
        state=StateSettings(
            shared_observations=True,
            shared_placements=True,
            shared_calibration=True,
            shared_scrapes=True,
        ),
    )
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        assert app.shared_placements is None and app.shared_observations is None
        assert app.shared_calibration is None and app.shared_scrapes is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("shared_placements needs a Redis index" in m for m in warned), warned
    assert any("shared_observations needs a Redis index" in m for m in warned), warned
    assert any("shared_calibration needs a Redis index" in m for m in warned), warned
    assert any("shared_scrapes needs a Redis index" in m for m in warned), warned


async def test_calibration_pooling_by_default_says_why_it_is_off_without_a_redis_index(
    settings: Settings, caplog: pytest.LogCaptureFixture
):
    # `state.shared_calibration: auto` (the default): on with a Redis index (tests/e2e
    # test_replica_calibration.py), off here, said at INFO, no warning.
    caplog.set_level(logging.INFO, logger="extproc.server")
    assert settings.state.shared_calibration == "auto"
    async with App(settings, parse_endpoints(",".join(settings.endpoints))) as app:
        assert app.shared_calibration is None
    said = [r for r in caplog.records if "shared_calibration" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.INFO, "state.shared_calibration auto: off (no Redis index)")
    ]


async def test_scrape_sharing_by_default_says_why_it_is_off_without_a_redis_index(
    settings: Settings, caplog: pytest.LogCaptureFixture
):
    # `state.shared_scrapes: auto` (the default): on with a Redis index
    # (tests/e2e/test_replica_scrapes.py), off here, said at INFO, no warning.
    caplog.set_level(logging.INFO, logger="extproc.server")
    assert settings.state.shared_scrapes == "auto"
    async with App(settings, parse_endpoints(",".join(settings.endpoints))) as app:
        assert app.shared_scrapes is None
    said = [r for r in caplog.records if "shared_scrapes" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.INFO, "state.shared_scrapes auto: off (no Redis index)")
    ]
