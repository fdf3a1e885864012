"""The admin port's /metrics covers the operations list of issue 7, and the Grafana dashboard
only queries metrics the picker really exports."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import msgspec
import orjson
import pytest

from extproc.config import IndexSettings, KVEventSettings, Settings
from extproc.endpoints import parse_endpoints
from extproc.hashing.tokenizer import PreciseSettings
from extproc.server.app import App
from extproc.testing import ExtProcClient, body_chunks, post, request_headers
from tests.redis_servers import RedisServer, free_port

ROOT = Path(__file__).parent.parent.parent
DASHBOARD = ROOT / "deploy" / "grafana" / "extproc-dashboard.json"
TOKENIZER = ROOT / "tests" / "fixtures" / "vllm-0.32-cpu" / "tokenizer"
CHAT = orjson.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "the same long prefix " * 40}]}
)


def exported_names(text: str) -> set[str]:
    """Every series name in an exposition, plus the names a family with no samples yet will
    have (counter `_total`; gauge as is), so a per-endpoint gauge counts before its first
    sample."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            names.add(f"{name}_total" if kind == "counter" else name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


async def route_one(app: App) -> None:
    async with ExtProcClient(f"127.0.0.1:{app.port}") as c:
        await c.exchange([request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)])


async def scrape(app: App) -> str:
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://127.0.0.1:{app.admin_port}/metrics")
    assert r.status_code == 200
    return r.text


@pytest.fixture
async def full_app(settings: Settings, redis_server: RedisServer) -> AsyncIterator[App]:
    """Every optional component on: Redis index, shared in-flight, precise keys with KV
    events (a bound socket, nothing publishing), endpoint scraping."""
    s = msgspec.structs.replace(
        settings,
        index=IndexSettings(
            backend="redis",
            redis_url=redis_server.url,
            kv_events=KVEventSettings(bind=f"tcp://127.0.0.1:{free_port()}"),
        ),
        parse=msgspec.structs.replace(
            settings.parse,
            precise=PreciseSettings(tokenizer_dir=str(TOKENIZER), model="tiny", block_size=16),
        ),
    )
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        yield app


async def test_metrics_cover_requests_latency_prefix_and_endpoints(app: App):
    await route_one(app)
    text = await scrape(app)
    names = exported_names(text)
    for name in (
        "extproc_requests_total",
        "extproc_decision_seconds_bucket",
        "extproc_index_lookup_seconds_bucket",
        "extproc_prefix_blocks_requested_total",
        "extproc_prefix_blocks_matched_total",
        "extproc_prefix_hit_ratio",
        "extproc_inflight_requests",
        "extproc_endpoint_stale",
        "extproc_endpoint_scrape_failures_total",
        "extproc_ready",
    ):
        assert name in names, name
    assert 'extproc_requests_total{outcome="routed",status="200"} 1.0' in text
    assert "extproc_index_lookup_seconds_count 1.0" in text
    assert "extproc_ready 1.0" in text


async def test_redis_and_kv_event_metrics_appear_with_those_components(full_app: App):
    await route_one(full_app)
    names = exported_names(await scrape(full_app))
    for name in (
        "extproc_index_write_errors_total",
        "extproc_index_lookups_degraded_total",
        "extproc_shared_inflight_errors_total",
        "extproc_shared_inflight_degraded",
        "extproc_shared_inflight_pushed_arrivals_total",
        "extproc_inflight_push_published_total",
        "extproc_inflight_push_degraded",
        "extproc_kv_events_gaps_total",
        "extproc_kv_events_last_message_age_seconds",
        "extproc_kv_events_silent",
        "extproc_kv_events_silent_periods_total",
        "extproc_kv_events_unanswered_placements",
        # A bound socket on a Redis index: silence is judged fleet-wide.
        "extproc_kv_events_silence_fleet_heard_total",
        "extproc_kv_events_silence_fleet_degraded",
        "extproc_precise_placement_corrections_total",
        "extproc_internal_errors_total",
    ):
        assert name in names, name


def dashboard_metric_names(doc: dict) -> set[str]:
    exprs = [t["expr"] for p in doc["panels"] for t in p.get("targets", [])]
    exprs += [v["query"] for v in doc["templating"]["list"] if v["type"] == "query"]
    assert exprs
    return {m for e in exprs for m in re.findall(r"\bextproc_[a-z0-9_]+", e)}


async def test_every_dashboard_query_uses_exported_metrics(full_app: App):
    doc = json.loads(DASHBOARD.read_text())
    await route_one(full_app)
    exported = exported_names(await scrape(full_app))
    used = dashboard_metric_names(doc)
    assert used - exported == set()
    # The dashboard covers the list, not a subset of it.
    for needed in ("extproc_index_lookup_seconds_bucket", "extproc_endpoint_state_age_seconds"):
        assert needed in used


async def test_shared_growth_runs_and_is_exported_unless_a_filter_turns_it_off(
    settings: Settings, redis_server: RedisServer
):
    """With a Redis index, bounded-sessions-filter's growth is shared by default: the exchange
    runs and its counters and degraded gauge are exported; `shareGrowth: false` builds none."""
    from extproc.scheduling.config import default_config

    cfg = default_config()
    plugins = [
        msgspec.structs.replace(p, parameters={"shareGrowth": False})
        if p.type == "bounded-sessions-filter"
        else p
        for p in cfg.plugins
    ]
    index = IndexSettings(backend="redis", redis_url=redis_server.url)
    s = msgspec.structs.replace(
        settings, index=index, scheduling=msgspec.structs.replace(cfg, plugins=plugins)
    )
    plain = msgspec.structs.replace(settings, index=index)
    async with App(plain, parse_endpoints(",".join(plain.endpoints))) as app:
        assert app.shared_growth is not None
        names = exported_names(await scrape(app))
        assert "extproc_shared_growth_applied_total" in names
        assert "extproc_shared_growth_degraded" in names
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        assert app.shared_growth is None
