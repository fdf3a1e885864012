"""Every stats field of every component reaches /metrics (server/families.py): a field added
to a stats dataclass without a metric family, or without a stated reason in `unexported`,
fails here. Each table is also run on a stats object with a distinct value per field, so a
declared mapping that exports the wrong field or nothing fails too."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import pkgutil
from typing import Any

import pytest

import extproc
from extproc.server.families import TABLES, StatsFamilies

# Stats dataclasses that are not a picker component's: the simulator's engine figures are
# served by the simulator's own /metrics (extproc/sim/metrics.py).
NOT_PICKER = {"extproc.sim.metrics.EngineStats"}
# Counted once for several features, exported through each owner's own stats class
# (SharedEndStats, SharedObservationsStats copy its counters into their fields).
VIA_OWNER = {"extproc.redis_broadcast.BroadcastStats"}


def _modules() -> list[str]:
    return [
        m.name
        for m in pkgutil.walk_packages(extproc.__path__, "extproc.")
        if "_proto" not in m.name and not m.name.endswith("__main__")
    ]


def stats_classes() -> dict[str, type]:
    """Every dataclass of the package whose name ends in Stats, by dotted name."""
    found: dict[str, type] = {}
    for name in _modules():
        module = importlib.import_module(name)
        for cls_name, cls in inspect.getmembers(module, inspect.isclass):
            ours = cls.__module__ == name and cls_name.endswith("Stats")
            if ours and dataclasses.is_dataclass(cls):
                found[f"{name}.{cls_name}"] = cls
    return found


def _resolve(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def test_every_stats_class_has_a_table():
    found = set(stats_classes())
    assert len(found) >= 10, found  # the walk itself works
    tabled = {t.stats for t in TABLES}
    assert found - NOT_PICKER - VIA_OWNER - tabled == set(), "stats class without an export table"
    assert tabled - found == set(), "table for a class that is gone"


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.stats.rpartition(".")[2])
def test_every_field_is_exported_or_excused(table: StatsFamilies):
    names = {f.name for f in dataclasses.fields(_resolve(table.stats))}
    declared = set(table.exported) | set(table.unexported)
    assert names - declared == set(), f"{table.stats}: fields without a metric"
    assert declared - names == set(), f"{table.stats}: table names fields that are gone"
    assert not set(table.exported) & set(table.unexported)
    for why in table.unexported.values():
        assert why.strip()


def _distinct(table: StatsFamilies) -> tuple[Any, dict[str, tuple[tuple[str, ...], float]]]:
    """A stats object with value 101, 102, ... per field (dict fields: one key, sized to the
    metric's labels), and what each field must produce: (label values, value)."""
    cls = _resolve(table.stats)
    stats = cls()
    expected: dict[str, tuple[tuple[str, ...], float]] = {}
    for i, f in enumerate(dataclasses.fields(cls)):
        if f.name not in table.exported:
            continue
        stat = table.exported[f.name]
        value = 101.0 + i
        current = getattr(stats, f.name)
        if isinstance(current, dict):
            key = tuple(f"k{j}" for j in range(len(stat.labels)))
            setattr(stats, f.name, {key if len(key) > 1 else key[0]: value})
            expected[f.name] = (key, value)
        else:
            setattr(stats, f.name, value)
            expected[f.name] = (stat.values, value)
    return stats, expected


@pytest.mark.parametrize("table", TABLES, ids=lambda t: t.stats.rpartition(".")[2])
def test_each_exported_field_lands_in_its_family(table: StatsFamilies):
    stats, expected = _distinct(table)
    families = {f.name: f for f in table.families(stats)}
    for field_name, (labels, value) in expected.items():
        stat = table.exported[field_name]
        # prometheus_client strips a counter's _total suffix from the family name.
        family = families[stat.name]
        assert family.type == stat.kind
        samples = {tuple(s.labels.values()): s.value for s in family.samples}
        assert samples.get(tuple(labels)) == value, (field_name, samples)


def test_a_label_tells_several_components_apart():
    from extproc.endpoints.kubernetes import WatchStats
    from extproc.server.families import WATCH

    a, b = WatchStats(lists=1), WatchStats(lists=2)
    fam = next(f for f in WATCH.families_of([a, b], "resource", ["pool", "objective"]))
    assert {s.labels["resource"]: s.value for s in fam.samples} == {"pool": 1, "objective": 2}


def test_without_a_label_several_components_sum():
    from extproc.latency.model import ModelStats
    from extproc.server.families import LATENCY_MODEL

    fams = LATENCY_MODEL.families_of([ModelStats(samples=2), ModelStats(samples=3)])
    fam = next(f for f in fams if f.name == "extproc_latency_samples")
    assert [s.value for s in fam.samples] == [5]


def test_dict_keys_listed_are_exported_before_they_are_seen():
    from extproc.endpoints.scrape import ScrapeStats
    from extproc.server.families import SCRAPE

    fam = next(
        f for f in SCRAPE.families(ScrapeStats())
        if f.name == "extproc_endpoint_cache_invalidations"
    )  # fmt: skip
    assert {s.labels["reason"]: s.value for s in fam.samples} == {"restart": 0, "unreachable": 0}
