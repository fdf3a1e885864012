"""placement-memory-scorer: a prefix group the index has forgotten everywhere goes back to
the endpoint that last took it, not to whichever endpoint took a new prefix least recently."""

from __future__ import annotations

import dataclasses

import msgspec

from extproc.core import Decision, InferenceRequest
from extproc.scheduling.config import EndpointPickerConfig, build_scheduler, default_config
from extproc.scheduling.plugins.placements import (
    PlacementMemory,
    PlacementMemoryScorer,
    sample_positions,
)
from extproc.scheduling.plugins.prefix import NoHitLRUScorer
from extproc.testing import plugin_registry

from .helpers import cand, req

HEADER = 2  # blocks every tenant shares (a chat template's header)


def tenant(t: int, blocks: int = 40, extra: int = 0) -> InferenceRequest:
    """Tenant `t`'s prompt: the shared header, then blocks of its own (chained keys: every
    key after the header differs between tenants); `extra` continues it further."""
    keys = (*range(1, HEADER + 1), *(1000 * (t + 1) + i for i in range(blocks - HEADER + extra)))
    return dataclasses.replace(req(blocks=0, tokens=64 * len(keys)), block_keys=keys)


def test_sample_positions_are_shared_by_every_length_and_end_at_the_last_block():
    assert sample_positions(0) == []
    assert sample_positions(1) == [0]
    for n in (2, 17, 150, 2048):
        ps = sample_positions(n)
        assert ps == sorted(set(ps)) and ps[-1] == n - 1
        assert len(ps) <= 4 * n.bit_length() + 1
        # a shorter request samples the same positions below its length
        assert [p for p in sample_positions(2 * n) if p < n - 1] == ps[:-1]


def test_memory_recalls_the_longest_prefix_and_its_last_placement():
    m = PlacementMemory(max_keys=10_000)
    m.remember(tenant(0).block_keys, "a")
    m.remember(tenant(1).block_keys, "b")
    # The same tenant with a longer question: its prefix was last on a.
    where, blocks = m.recall(tenant(0, extra=5).block_keys)
    assert where == "a" and HEADER < blocks <= 40
    # A new tenant matches only the header, which b took last.
    assert m.recall(tenant(2).block_keys) == ("b", HEADER)
    m.remember(tenant(0).block_keys, "c")
    assert m.recall(tenant(0).block_keys)[0] == "c"
    m.forget_endpoint("c")
    assert m.recall(tenant(0).block_keys) in (None, ("b", 2))
    small = PlacementMemory(max_keys=20)
    for t in range(10):
        small.remember(tenant(t).block_keys, "a")
    assert len(small) <= 20


def test_scorer_sends_a_forgotten_tenant_back_and_leaves_others_alone():
    s = PlacementMemoryScorer()
    names = ("a", "b", "c", "d")
    header = [cand(x, prefix=HEADER) for x in names]
    for t in range(len(names)):
        s.observe(tenant(t), header, Decision(endpoints=(header[t].endpoint,)))
    # Tenant 2 evicted everywhere (the index credits the header only): back to c.
    assert s.score(tenant(2, extra=3), header) == [0.0, 0.0, 1.0, 0.0]
    # Resident somewhere: the index decides, not the memory.
    warm = [cand("a", prefix=30), *(cand(x, prefix=HEADER) for x in names[1:])]
    assert s.score(tenant(2), warm) == [1.0] * 4
    # A tenant never seen: nothing remembered beyond the header.
    assert s.score(tenant(9), header) == [1.0] * 4
    # Its home filtered out (load): no preference.
    assert s.score(tenant(2), header[:2]) == [1.0, 1.0]


def test_no_hit_lru_leaves_a_remembered_tenant_to_the_memory():
    memory = PlacementMemoryScorer()
    lru = NoHitLRUScorer()
    lru.bind({"m": memory, "l": lru})
    names = ("a", "b", "c", "d")
    header = [cand(x, prefix=HEADER) for x in names]
    for t in range(len(names)):
        r = tenant(t)
        d = Decision(endpoints=(header[t].endpoint,))
        # Observed without scoring, the memory first: no-hit-lru still sees a new prefix.
        memory.observe(r, header, d)
        lru.observe(r, header, d)
    assert list(lru._recent) == list(names)  # four new tenants: four cold picks
    again = tenant(3, extra=2)
    assert lru.score(again, header) == [1.0] * 4
    new = lru.score(tenant(7), header)
    assert new[0] == max(new) > new[3]  # new: a took a new prefix least recently


DEFAULT_WITH_MEMORY = """
plugins:
- {type: bounded-sessions-filter}
- {type: bounded-load-filter}
- {type: predicted-ttft-scorer}
- {type: kv-cache-utilization-scorer}
- {type: no-hit-lru-scorer}
- {type: session-tail-scorer}
- {type: placement-memory-scorer}
- {type: max-score-picker}
schedulingProfiles:
- name: default
  plugins:
  - {pluginRef: bounded-sessions-filter}
  - {pluginRef: bounded-load-filter}
  - {pluginRef: predicted-ttft-scorer, weight: 4}
  - {pluginRef: kv-cache-utilization-scorer, weight: 1}
  - {pluginRef: no-hit-lru-scorer, weight: 1}
  - {pluginRef: session-tail-scorer, weight: 2}
  - {pluginRef: placement-memory-scorer, weight: 1}
  - {pluginRef: max-score-picker}
"""


def _evicted_tenant_goes_to(config: EndpointPickerConfig) -> tuple[str, str]:
    """Four tenants placed one per server, every one then evicted everywhere; tenant 3
    comes back. Returns (where tenant 3 lived, where it goes now)."""
    sched = build_scheduler(config, plugin_registry())
    names = ("a", "b", "c", "d")
    header = [cand(x, prefix=HEADER, prefill_tps=10_000.0) for x in names]
    first = {}
    for t in range(4):
        r = tenant(t)
        d = sched.schedule(r, header)
        sched.observe(r, header, d)
        first[t] = d.primary.address
    assert sorted(first.values()) == list(names)  # four new prefixes spread
    # Idle fleet, nothing beyond the header credited anywhere: a near-tie on every server.
    idle = [cand(x, prefix=HEADER, prefill_tps=10_000.0) for x in names]
    r = tenant(3, extra=4)
    return first[3], sched.schedule(r, idle).primary.address


def test_default_profile_with_the_memory_sends_an_evicted_tenant_home():
    config = msgspec.yaml.decode(DEFAULT_WITH_MEMORY.encode(), type=EndpointPickerConfig)
    home, now = _evicted_tenant_goes_to(config)
    assert now == home


def test_default_profile_deals_an_evicted_tenant_out_as_new():
    # What the memory changes: without it the tenant is a new prefix, sent to the server
    # that took a new prefix least recently (the one tenant 0 went to), not its own.
    home, now = _evicted_tenant_goes_to(default_config())
    assert now != home
