"""Small Prometheus metric stores for hot paths: histograms and counters kept as plain dicts
and lists (a bisect and two adds per observation, no locks: the event loop is the only
writer), turned into metric families only when Prometheus scrapes. Used by llmd_metrics.py.

Families may be exported under fewer labels than are stored (`project`), summing the children
that collapse together; bucket bounds are written the way Go's client writes them, so `le`
strings match those of the Go exporters whose names we also export.
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Callable, Mapping, Sequence
from decimal import Decimal

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)

OVERFLOW_LABEL = "other"


class BoundedLabel:
    """Passes the first `limit` distinct values through, then answers `OVERFLOW_LABEL`."""

    __slots__ = ("_limit", "_seen")

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._seen: set[str] = set()

    def __call__(self, value: str) -> str:
        if value in self._seen or not value:
            return value
        if len(self._seen) >= self._limit:
            return OVERFLOW_LABEL
        self._seen.add(value)
        return value


Key = tuple[str, ...]


class Histogram:
    """Prometheus histogram children by label values; `le` semantics (v <= bound)."""

    __slots__ = ("bounds", "children")

    def __init__(self, buckets: Sequence[float]) -> None:
        self.bounds = tuple(float(b) for b in buckets)
        self.children: dict[Key, list[float]] = {}  # counts per bucket (+Inf last), then sum

    def child(self, key: Key) -> Callable[[float], None]:
        """An `observe(value)` for one label set; resolve once, call often."""
        slot = self.children.get(key)
        if slot is None:
            slot = self.children[key] = [0.0] * (len(self.bounds) + 2)
        bounds, total = self.bounds, len(self.bounds) + 1

        def observe(value: float) -> None:
            slot[bisect_left(bounds, value)] += 1
            slot[total] += value

        return observe

    def slot(self, key: Key) -> list[float]:
        """The child's storage (bucket counts, +Inf, then the sum), created on first use; the
        hot path adds to it directly with `add`."""
        slot = self.children.get(key)
        if slot is None:
            slot = self.children[key] = [0.0] * (len(self.bounds) + 2)
        return slot

    def observe(self, key: Key, value: float) -> None:
        slot = self.children.get(key)
        if slot is None:
            slot = self.children[key] = [0.0] * (len(self.bounds) + 2)
        slot[bisect_left(self.bounds, value)] += 1
        slot[-1] += value

    def family(self, name: str, doc: str, labels: Sequence[str], project=None):
        """`project` maps a stored key to the family's label values (children that map to the
        same values are summed: the legacy families have fewer labels)."""
        merged: dict[Key, list[float]] = {}
        for key, slot in self.children.items():
            k = project(key) if project else key
            acc = merged.get(k)
            if acc is None:
                merged[k] = list(slot)
            else:
                for i, v in enumerate(slot):
                    acc[i] += v
        fam = HistogramMetricFamily(name, doc, labels=list(labels))
        for k, slot in merged.items():
            cumulative, buckets = 0.0, []
            for bound, count in zip((*self.bounds, math.inf), slot, strict=False):
                cumulative += count
                buckets.append((_le(bound), cumulative))
            fam.add_metric(list(k), buckets, sum_value=slot[-1])
        return fam


def add(bounds: tuple[float, ...], slot: list[float], value: float) -> None:
    slot[bisect_left(bounds, value)] += 1
    slot[-1] += value


def _le(bound: float) -> str:
    """A bucket bound as Go's client writes it (`strconv.FormatFloat(f, 'g', -1, 64)`: the
    shortest digits, exponent form from 1e6 up or below 1e-4), so `le` values are the same
    strings llm-d's router exposes ("1", "0.005", "1.048576e+06")."""
    if bound == math.inf:
        return "+Inf"
    d = Decimal(repr(bound)).normalize()
    exp = d.adjusted()
    if exp < -4 or exp >= 6:
        digits = str(d.as_tuple().digits[0])
        rest = "".join(str(x) for x in d.as_tuple().digits[1:])
        mantissa = f"{digits}.{rest}" if rest else digits
        return f"{mantissa}e{'-' if exp < 0 else '+'}{abs(exp):02d}"
    return format(d, "f")


class Counter:
    __slots__ = ("values",)

    def __init__(self) -> None:
        self.values: dict[Key, float] = {}

    def inc(self, key: Key, by: float = 1.0) -> None:
        self.values[key] = self.values.get(key, 0.0) + by

    def family(self, name: str, doc: str, labels: Sequence[str], project=None):
        fam = CounterMetricFamily(name, doc, labels=list(labels))
        for k, v in merge(self.values, project).items():
            fam.add_metric(list(k), v)
        return fam


def merge(values: Mapping[Key, float], project) -> dict[Key, float]:
    if project is None:
        return dict(values)
    out: dict[Key, float] = {}
    for key, v in values.items():
        k = project(key)
        out[k] = out.get(k, 0.0) + v
    return out


def gauge_family(name: str, doc: str, labels: Sequence[str], values: Mapping[Key, float]):
    fam = GaugeMetricFamily(name, doc, labels=list(labels))
    for k, v in values.items():
        fam.add_metric(list(k), v)
    return fam


# Stored request key: (model_name, target_model_name, fairness_id, priority).
