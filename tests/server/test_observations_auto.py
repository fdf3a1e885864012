"""`state.shared_observations: auto` decides at build time: on with a non-Cluster Redis index
when the scheduler has something to share, off otherwise with the reason, said once the
ports are bound. Building connects to nothing (server/assembly.py), so these need no Redis;
sharing itself is tests/server/test_shared_observations.py's and
tests/e2e/test_replica_observations.py's."""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import pytest

from extproc.config import Settings, decode_settings
from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.server.assembly import Parts

REDIS = "redis://127.0.0.1:1/0"  # never dialled: nothing here runs
ON = (
    "state.shared_observations auto: on (Redis index): replicas share new-prefix picks and "
    "prefill-speed samples"
)

# A profile with neither a `no-hit-lru-scorer` nor any reader of prefill speeds.
LOAD_ONLY = {
    "plugins": [{"type": "queue-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "queue-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}
# The same with predicted TTFT, which reads prefill speeds.
WITH_TTFT = {
    "plugins": [{"type": "predicted-ttft-scorer"}, {"type": "max-score-picker"}],
    "schedulingProfiles": [
        {
            "name": "default",
            "plugins": [
                {"pluginRef": "predicted-ttft-scorer", "weight": 1},
                {"pluginRef": "max-score-picker"},
            ],
        }
    ],
}


def built(base: Settings, doc: dict[str, Any]) -> Parts:
    s = decode_settings(doc)
    s = msgspec.structs.replace(s, endpoints=base.endpoints, server=base.server)
    return Parts(s, parse_endpoints(",".join(s.endpoints)))


def redis(cluster: bool = False, **extra: Any) -> dict[str, Any]:
    return {"backend": "redis", "redis_url": REDIS, "cluster": cluster, **extra}


def test_auto_is_on_with_a_redis_index_and_the_default_profile(settings: Settings):
    parts = built(settings, {"index": redis(), "state": {"shared_observations": "auto"}})
    assert parts.shared_observations is not None
    assert parts.observation_sharing == ON


@pytest.mark.parametrize(
    ("index", "why"),
    [
        (redis(cluster=True), "Redis Cluster"),
        ({"backend": "memory"}, "no Redis index"),
    ],
)
def test_auto_is_off_without_a_plain_redis_index(settings: Settings, index, why):
    parts = built(settings, {"index": index, "state": {"shared_observations": "auto"}})
    assert parts.shared_observations is None
    assert parts.observation_sharing == f"state.shared_observations auto: off ({why})"


def test_auto_is_off_when_the_scheduler_has_nothing_to_share(settings: Settings):
    doc = {"index": redis(), "state": {"shared_observations": "auto"}, "scheduling": LOAD_ONLY}
    parts = built(settings, doc)
    assert parts.shared_observations is None
    assert parts.observation_sharing == (
        "state.shared_observations auto: off (nothing to share: no no-hit-lru-scorer, and "
        "nothing reads prefill speeds (no predicted-ttft-scorer, index.lookup_budget fixed, "
        "no flow control))"
    )


@pytest.mark.parametrize(
    "doc",
    [
        {"scheduling": WITH_TTFT},
        {"scheduling": LOAD_ONLY, "index": redis(lookup_budget="prefill")},
        {"scheduling": LOAD_ONLY, "flow_control": {}},
    ],
    ids=["predicted-ttft", "lookup-budget", "flow-control"],
)
def test_auto_shares_speeds_for_a_reader_without_new_prefix_spreading(settings: Settings, doc):
    doc = {"index": redis(), **doc, "state": {"shared_observations": "auto"}}
    parts = built(settings, doc)
    assert parts.shared_observations is not None
    assert parts.observation_sharing == ON


@pytest.mark.parametrize(("forced", "on"), [(True, True), (False, False)])
def test_true_and_false_force_it_without_the_auto_line(settings: Settings, forced, on):
    # `true` on a profile with nothing to share still shares: what was asked for.
    for scheduling in ({}, {"scheduling": LOAD_ONLY}):
        doc = {"index": redis(), "state": {"shared_observations": forced}, **scheduling}
        parts = built(settings, doc)
        assert (parts.shared_observations is not None) is on
        assert parts.observation_sharing is None


def test_the_default_is_auto_on_with_a_redis_index(settings: Settings):
    # `auto` by default (config.py says why beside the field).
    parts = built(settings, {"index": redis()})
    assert parts.settings.state.shared_observations == "auto"
    assert parts.shared_observations is not None and parts.observation_sharing == ON


async def test_auto_says_why_it_is_off_once_the_ports_are_bound(
    settings: Settings, caplog: pytest.LogCaptureFixture
):
    caplog.set_level(logging.INFO, logger="extproc.server")
    s = decode_settings({"state": {"shared_observations": "auto"}})
    s = msgspec.structs.replace(s, endpoints=settings.endpoints, server=settings.server)
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        assert app.shared_observations is None
    said = [r for r in caplog.records if "shared_observations" in r.getMessage()]
    assert [(r.levelno, r.getMessage()) for r in said] == [
        (logging.INFO, "state.shared_observations auto: off (no Redis index)")
    ]
