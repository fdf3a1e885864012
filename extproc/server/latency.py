"""How the app runs latency models it finds among the scheduling plugins: one learner loop
per model (the `predicted-latency-producer` owns one), and their Prometheus figures."""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from extproc.endpoints.latency_learner import LatencyLearner
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.state import EndpointStates
from extproc.latency.model import LatencyModel
from extproc.server.families import LATENCY_MODEL


@runtime_checkable
class OwnsLatencyModel(Protocol):
    """A plugin holding a model the app must teach; `learn_interval_s` paces its loop."""

    model: LatencyModel

    @property
    def learn_interval_s(self) -> float: ...


def learners(
    plugins: Iterable[object], pool: EndpointPool, states: EndpointStates | None
) -> list[LatencyLearner]:
    """One learner per plugin that owns a latency model; `states` None: scraping is off."""
    return [
        LatencyLearner(p.model, pool, states, interval_s=p.learn_interval_s)
        for p in plugins
        if isinstance(p, OwnsLatencyModel)
    ]


def collect(found: Sequence[LatencyLearner], plugins: Iterable[object]) -> Iterator:
    """Metric families for the learners (docs/operations.md lists them)."""
    if not found:
        return
    learning = GaugeMetricFamily(
        "extproc_latency_learning",
        "1 when the latency model can learn (metrics scraping on), else 0: latency plugins "
        "then score on load.",
    )
    endpoints = GaugeMetricFamily(
        "extproc_latency_endpoints",
        "Endpoints by latency-model state: warm (own fit) or no_histograms (exports no "
        "latency histograms; predicted from the fleet's fit).",
        labels=["state"],
    )
    throughput = GaugeMetricFamily(
        "extproc_latency_prefill_tokens_per_second",
        "Prefill throughput the latency model learned per endpoint (uncached tokens/s).",
        labels=["endpoint"],
    )
    terms = GaugeMetricFamily(
        "extproc_latency_model_seconds",
        "The latency model's fitted terms per endpoint: per_request and per_token (prefill "
        "seconds), overhead (engine time beyond queue and prefill), transport (outside the "
        "engine, from response headers).",
        labels=["endpoint", "term"],
    )
    scale = GaugeMetricFamily(
        "extproc_latency_token_scale",
        "Engine prompt tokens per token the picker estimates (learned).",
    )
    queued = GaugeMetricFamily(
        "extproc_latency_backlog_requests",
        "Per endpoint, this picker's placements without a first token yet (the queue the "
        "TTFT prediction prices).",
        labels=["endpoint"],
    )
    trimmed = CounterMetricFamily(
        "extproc_latency_backlog_trimmed",
        "Placements dropped from the latency model's queue because the engine reported fewer "
        "waiting and running requests (failed, cancelled, or counted as others' work).",
    )
    for learner in found:
        scale.add_metric([], learner.model.token_scale)
        for address, b in learner.model.backlogs().items():
            queued.add_metric([address], len(b))
        trimmed.add_metric([], sum(b.trimmed for b in learner.model.backlogs().values()))
        for address, c in learner.model.all_coefficients().items():
            terms.add_metric([address, "per_request"], c.per_request_s)
            terms.add_metric([address, "per_token"], c.per_token_s)
            terms.add_metric([address, "overhead"], c.overhead_s)
            transport = learner.model.transport_s(address)
            if transport is not None:
                terms.add_metric([address, "transport"], transport)
    for learner in found:
        model = learner.model
        learning.add_metric([], 1.0 if learner.scraping else 0.0)
        endpoints.add_metric(["warm"], model.warm_endpoints)
        endpoints.add_metric(["no_histograms"], len(learner.missing))
        for address, c in model.all_coefficients().items():
            if c.per_token_s > 0:
                throughput.add_metric([address], c.tokens_per_s)
    fallbacks = CounterMetricFamily(
        "extproc_latency_scorer_fallbacks",
        "Requests the latency-scorer scored on load because nothing was predicted.",
    )
    fallbacks.add_metric(
        [], sum(getattr(p, "fallbacks", 0) for p in plugins if _is(p, "latency-scorer"))
    )
    shed = CounterMetricFamily(
        "extproc_latency_shed", "Requests the latency-slo-admitter shed (429)."
    )
    shed.add_metric(
        [], sum(getattr(p, "shed", 0) for p in plugins if _is(p, "latency-slo-admitter"))
    )
    # ModelStats fields, through their table (server/families.py).
    yield from LATENCY_MODEL.families_of([learner.model.stats for learner in found])
    yield from (learning, endpoints, throughput, terms, scale, queued, trimmed, fallbacks,
                shed)  # fmt: skip


def _is(plugin: object, type_name: str) -> bool:
    return getattr(plugin, "type_name", None) == type_name
