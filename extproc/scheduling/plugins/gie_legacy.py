"""The Gateway API Inference Extension's v0.5 chart-default plugins (low-queue, LoRA
affinity, least-queue and least-KV filters chained by a decision tree, and the
`kv-cache-scorer` name), so its published `default-plugins.yaml` / `plugins-v2.yaml` load
unchanged. Semantics follow GIE v0.5."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, InferenceRequest
from extproc.errors import ConfigError
from extproc.scheduling.framework import Filter
from extproc.scheduling.plugins.scorers import KVCacheUtilizationScorer


class _NoParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    pass


class LowQueueFilter:
    """Keeps endpoints with at most `threshold` (128) waiting requests.

    ```yaml
    - type: low-queue-filter
      parameters: {threshold: 128}
    ```
    """

    type_name: ClassVar[str] = "low-queue-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        threshold: Annotated[int, msgspec.Meta(ge=0)] = 128

    def __init__(self, params: Params | None = None) -> None:
        self._max = (params or self.Params()).threshold

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        return [c for c in cands if c.state.waiting <= self._max]


def _lowest_band(values: Sequence[float], cands: Sequence[Candidate]) -> list[Candidate]:
    """GIE's least-* rule: keep values within (max - min) / n of the minimum."""
    if not cands:
        return []
    low, high = min(values), max(values)
    top = low + (high - low) / len(cands)
    return [c for c, v in zip(cands, values, strict=True) if low <= v <= top]


class LeastQueueFilter:
    """Keeps the endpoints whose waiting queue is within (max - min) / n of the shortest.

    ```yaml
    - type: least-queue-filter
    ```
    """

    type_name: ClassVar[str] = "least-queue-filter"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        # GIE divides integers here: the band is floor((max - min) / n).
        waits = [c.state.waiting for c in cands]
        if not cands:
            return []
        low = min(waits)
        top = low + (max(waits) - low) // len(cands)
        return [c for c, w in zip(cands, waits, strict=True) if low <= w <= top]


class LeastKVCacheFilter:
    """Keeps the endpoints whose KV-cache use is within (max - min) / n of the lowest.

    ```yaml
    - type: least-kv-cache-filter
    ```
    """

    type_name: ClassVar[str] = "least-kv-cache-filter"
    Params = _NoParams

    def __init__(self, params: _NoParams | None = None) -> None:
        pass

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        return _lowest_band([c.state.kv_usage for c in cands], cands)


class LoraAffinityFilter:
    """For the request's target (its LoRA adapter, else its model): endpoints already
    running or loading it ("affinity"), or with a free adapter slot ("available"). When both
    exist, affinity wins with probability `threshold` (0.999); otherwise whichever exists.

    ```yaml
    - type: lora-affinity-filter
      parameters: {threshold: 0.999}
    ```
    """

    type_name: ClassVar[str] = "lora-affinity-filter"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        threshold: Annotated[float, msgspec.Meta(ge=0, le=1)] = 0.999

    def __init__(self, params: Params | None = None, *, rng: random.Random | None = None):
        self._threshold = (params or self.Params()).threshold
        self._rng = rng or random.Random()

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        target = req.lora_adapter or req.model
        affinity, available = [], []
        for c in cands:
            s = c.state
            if target in s.running_adapters or target in s.waiting_adapters:
                affinity.append(c)
            elif len(s.running_adapters) + len(s.waiting_adapters) < (s.max_adapters or 0):
                available.append(c)
        if affinity and available:
            return affinity if self._rng.random() < self._threshold else available
        return affinity or available


class TreeEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    plugin_ref: str | None = None
    decision_tree: DecisionTree | None = None

    def __post_init__(self) -> None:
        if (self.plugin_ref is None) == (self.decision_tree is None):
            raise ValueError("give exactly one of pluginRef and decisionTree")


class DecisionTree(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    current: TreeEntry
    next_on_success: TreeEntry | None = None
    next_on_failure: TreeEntry | None = None
    next_on_success_or_failure: TreeEntry | None = None


class _Node:
    """A resolved tree: filters by name replaced by the plugin instances."""

    def __init__(self, tree: DecisionTree, plugins: Mapping[str, object]) -> None:
        self.current = _entry(tree.current, plugins)
        self.on_success = _entry(tree.next_on_success, plugins)
        self.on_failure = _entry(tree.next_on_failure, plugins)
        self.either = _entry(tree.next_on_success_or_failure, plugins)

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        kept = self.current.filter(req, cands)
        if kept:
            nxt = self.on_success or self.either
            return nxt.filter(req, kept) if nxt else kept
        nxt = self.on_failure or self.either
        return nxt.filter(req, cands) if nxt else kept


def _entry(entry: TreeEntry | None, plugins: Mapping[str, object]) -> Filter | _Node | None:
    if entry is None:
        return None
    if entry.decision_tree is not None:
        return _Node(entry.decision_tree, plugins)
    name = entry.plugin_ref or ""
    plugin = plugins.get(name)
    if plugin is None:
        raise ConfigError(f"no plugin named {name!r}", path=("pluginRef",))
    if not isinstance(plugin, Filter):
        raise ConfigError(f"{name!r} is not a filter", path=("pluginRef",))
    return plugin


class DecisionTreeFilter:
    """Chains filters: run `current`; when it keeps someone, continue with `nextOnSuccess`
    on what it kept, otherwise with `nextOnFailure` on the original candidates;
    `nextOnSuccessOrFailure` covers both. Entries name a filter (`pluginRef`) or nest a
    `decisionTree`.

    ```yaml
    - type: decision-tree-filter
      name: low-latency-filter
      parameters:
        current: {pluginRef: low-queue-filter}
        nextOnSuccess: {decisionTree: {current: {pluginRef: least-queue-filter}}}
        nextOnFailure: {pluginRef: least-kv-cache-filter}
    ```
    """

    type_name: ClassVar[str] = "decision-tree-filter"
    Params = DecisionTree

    def __init__(self, params: DecisionTree) -> None:
        self._tree = params
        self._root: _Node | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._root = _Node(self._tree, plugins)

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        if self._root is None:  # built without a config: nothing to chain
            raise RuntimeError("decision-tree-filter used before its plugins were resolved")
        return self._root.filter(req, cands)


class KVCacheScorer(KVCacheUtilizationScorer):
    """GIE v0.5's name of `kv-cache-utilization-scorer` (same behaviour).

    ```yaml
    - type: kv-cache-scorer
    ```
    """

    type_name: ClassVar[str] = "kv-cache-scorer"
