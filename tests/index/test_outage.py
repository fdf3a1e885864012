"""A failing spell of one direction of the remote index (index/outage.py): one warning when
it starts, one info line when it ends (how long, what was skipped), the state in
`IndexStats.degraded` and the spells in `IndexStats.outages`."""

from __future__ import annotations

import logging

import pytest

from extproc.index.base import IndexStats
from extproc.index.outage import LOOKUPS, WRITES, Spell

log = logging.getLogger("test.outage")


def test_a_spell_is_said_once_each_way_with_its_length_and_what_was_skipped(
    caplog: pytest.LogCaptureFixture,
):
    caplog.set_level(logging.INFO, logger="test.outage")
    now = [10.0]
    stats = IndexStats()
    spell = Spell(LOOKUPS, stats, log, lambda: (stats.lookups_degraded,), lambda: now[0])
    Spell(WRITES, stats, log, lambda: (0,))
    assert stats.degraded == {"lookups": 0, "writes": 0} and stats.outages["lookups"] == 0
    assert spell.back(lambda g: f"{g[0]} skipped") is None  # not failing: nothing to say
    assert spell.failing(ConnectionError("refused"), "routed on load")
    for _ in range(5):
        stats.lookups_degraded += 1
        assert not spell.failing(ConnectionError("refused"), "routed on load")
    assert stats.degraded["lookups"] == 1 and spell.failing_now
    now[0] += 2.5
    assert spell.back(lambda g: f"{g[0]} skipped") == 2.5
    assert spell.back(lambda g: f"{g[0]} skipped") is None
    assert stats.degraded["lookups"] == 0 and stats.outages["lookups"] == 1
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.WARNING, "kv index: lookups failing (ConnectionError('refused')); routed on load"),
        (logging.INFO, "kv index: lookups resume after 2.5 s down (5 skipped)"),
    ]
    # The next spell is a new one.
    assert spell.failing(TimeoutError(), "routed on load")
    assert stats.outages["lookups"] == 2
