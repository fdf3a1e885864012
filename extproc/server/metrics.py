"""Prometheus metrics of one picker process, in its own registry (no global state).

Counters that other components already keep (router, index, KV-event ingestion, in-flight,
scraper) are read at scrape time by a collector, so the hot path pays nothing for them; only
the per-request outcome counter and the decision and index-lookup latency histograms are
updated inline. docs/operations.md lists every metric; llm-d's and GIE's names are in
llmd_metrics.py (docs/llm-d.md#metrics).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from extproc.server import metric_stores as stores
from extproc.server.llmd_metrics import LlmdMetrics

_LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5)


class PickerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "extproc_requests",
            "Requests seen by the picker, by outcome (routed, rejected, error) and HTTP status.",
            ["outcome", "status"],
            registry=self.registry,
        )
        # Per-request histograms as plain stores (metric_stores): prometheus_client's
        # observe() takes a lock and walks the buckets, ~4x the cost (issue 17).
        self.decision_seconds = _Latency(
            "extproc_decision_seconds",
            "Time from the end of the request body to the decision (parse, hash, index "
            "lookup, scheduling).",
        )
        self.lookup_seconds = _Latency(
            "extproc_index_lookup_seconds",
            "Time of one KV-block index lookup (Redis round trip, or the in-memory walk); "
            "only requests with block keys look up.",
        )
        self.add_collector(lambda: (self.decision_seconds.family(), self.lookup_seconds.family()))
        self.without_body = Counter(
            "extproc_decisions_without_body",
            "Decisions made on headers alone because the proxy's body mode never shows the "
            "whole body (STREAMED, NONE, a BUFFERED_PARTIAL body cut at its limit): no prefix "
            "affinity for these requests.",
            ["mode"],
            registry=self.registry,
        )
        self.internal_errors = Counter(
            "extproc_internal_errors",
            "Requests answered 500 because the picker raised something unexpected (a bug): "
            "each is logged with its traceback, at most one line per exception type per "
            "10 s, the next line counting those left out (suppressed_since_last).",
            registry=self.registry,
        )
        # Children resolved once: labels() costs microseconds per call on the hot path.
        self.routed = self.requests.labels("routed", "200")
        # llm-d's and GIE's families (server/llmd_metrics.py), fed by the same stream events.
        self.llmd = LlmdMetrics()
        self.add_collector(self.llmd.collect)

    def rejected(self, status: int) -> None:
        outcome = "error" if status >= 500 and status != 503 else "rejected"
        self.requests.labels(outcome, str(status)).inc()

    def add_collector(self, collect: Callable[[], Iterable]) -> None:
        """Register a function yielding metric families, called at every scrape."""

        class _Fn(Collector):
            def collect(self):
                return collect()

        self.registry.register(_Fn())

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class _Latency:
    """One unlabelled latency histogram: `observe(seconds)` on the hot path, `family()` at
    scrape time."""

    __slots__ = ("_doc", "_name", "_store", "observe")

    def __init__(self, name: str, doc: str) -> None:
        self._name, self._doc = name, doc
        self._store = stores.Histogram(_LATENCY_BUCKETS)
        self.observe = self._store.child(())

    def family(self):
        return self._store.family(self._name, self._doc, ())


def gauge(name: str, doc: str, labels: Iterable[str] = ()) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, labels=list(labels))


def counter(name: str, doc: str, labels: Iterable[str] = ()) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, labels=list(labels))
