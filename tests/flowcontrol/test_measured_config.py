"""The overload configuration docs/flow-control.md documents ("Measured") is the one the
overload bench measured as `J` (bench/bench_overload.py's `picker_config` for that run name):
it loads as a picker's configuration, and its flow-control plugins, `flowControl` section and
`flow_control` settings are the bench's, the settings the bench writes out and the document
leaves to `auto` resolving to the bench's values. A change to either that the other does not
follow fails here, so the figures quoted beside the block stay the block's."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import msgspec
import yaml

from extproc.config import (
    build_configured_flow_control,
    build_configured_scheduler,
    decode_settings,
)
from extproc.flowcontrol.admission import Admission
from extproc.flowcontrol.config import FLOW_PLUGINS
from extproc.flowcontrol.objectives import Objectives
from extproc.scheduling.plugins import BUILTINS
from extproc.scheduling.registry import PluginRegistry
from tests.bench_modules import bench_modules

DOC = Path(__file__).resolve().parents[2] / "docs" / "flow-control.md"
MARKER = "<!-- the measured overload configuration"


def documented() -> dict[str, Any]:
    text = DOC.read_text()
    block = re.search(r"```yaml\n(.*?)^```", text[text.index(MARKER) :], re.M | re.S)
    assert block is not None
    return yaml.safe_load(block.group(1))


def measured(doc: dict[str, Any]) -> dict[str, Any]:
    """`J` = `on@0.99-gate-refill300-pf-ends20-spike300-sq95-sj-rfs-gh-ev` as the bench
    builds it, with the documented block `doc`'s measured figures (kvCacheFraction, the
    prior)."""
    with bench_modules("bench_overload") as (bench,):
        return bench.picker_config(
            Path("objectives.yaml"),
            flow=True,
            min_ceiling=0.99,
            kv_ratio=1.244,
            ttl_s=4,
            reserve=1,
            expected_output=bench.OUTPUT_TOKENS + 64,
            prior=doc["flow_control"]["reserve_prior"][10],
            gate_tokens=2048,
            gate_at_start=True,
            reserve_refill_s=0.3,
            refill_credit="started",
            spike_s=0.3,
            spike_quantile=0.95,
            spike_joint=True,
            dispatch_on_end=True,
            evict=True,
        )


def params(entry: dict[str, Any]) -> Any:
    """A plugin entry's parameters with their defaults filled in."""
    name = entry["type"]
    flow = {c.type_name: c.Params for c in FLOW_PLUGINS}
    cls = flow[name] if name in flow else PluginRegistry(BUILTINS).get(name).Params
    return msgspec.convert(entry.get("parameters") or {}, cls)


def test_the_documented_configuration_loads_with_the_joint_reserve():
    settings = decode_settings(documented())
    build_configured_scheduler(settings)
    flow = build_configured_flow_control(settings)
    assert flow is not None
    adm = Admission(flow, lambda: [], objectives=Objectives(table={}))
    spike = adm.spike_settings
    assert (spike.joint, spike.quantile, spike.credit) == (True, 0.95, "started")


def test_the_documented_configuration_is_what_the_bench_measured():
    doc = documented()
    bench = measured(doc)
    ours = {e["type"]: params(e) for e in doc["scheduling"]["plugins"]}
    theirs = {e["type"]: params(e) for e in bench["scheduling"]["plugins"] if e["type"] in ours}
    assert theirs == ours
    for section in ("schedulingProfiles", "flowControl"):
        assert bench["scheduling"][section] == doc["scheduling"][section], section
    # The documented settings are the bench's; what the bench writes besides them is its
    # own plumbing or what the document leaves to `auto` (resolved above to the same).
    fc, bench_fc = doc["flow_control"], dict(bench["flow_control"])
    for key, value in fc.items():
        assert bench_fc.pop(key) == value, key
    assert bench_fc == {
        "objectives_file": "objectives.yaml",
        "retry_after_s": 2,
        "reserve_refill_credit": "started",
        "reserve_spike_quantile": 0.95,
        "reserve_spike_joint": True,
    }
