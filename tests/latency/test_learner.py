"""The learner loop: it feeds the model from the scraper's store, only new scrapes, and says
so when it cannot learn (scraping off, an endpoint without latency histograms)."""

from __future__ import annotations

import logging

import pytest

from extproc.core import Endpoint
from extproc.endpoints.exposition import Scraped
from extproc.endpoints.latency_learner import LatencyLearner
from extproc.endpoints.pool import EndpointPool
from extproc.endpoints.state import EndpointStates
from extproc.latency import LatencyModel
from tests.latency.synthetic import Engine


def test_learns_from_new_scrapes_only_and_follows_the_pool() -> None:
    pool = EndpointPool([Endpoint("a:1"), Endpoint("b:1")])
    states = EndpointStates()
    model = LatencyModel()
    learner = LatencyLearner(model, pool, states)
    eng = Engine()
    for i in range(8):
        states.update("a:1", Scraped(running=2, latency=eng.interval([500 + 100 * i, 900])))
        learner.step()
        learner.step()  # the same scrape again teaches nothing
    assert model.stats.samples == 7  # the first scrape is the baseline
    c = model.coefficients("a:1")
    assert c is not None and c.per_token_s == pytest.approx(eng.per_token_s, rel=0.02)
    pool.replace([Endpoint("b:1")])
    learner.step()
    assert model.coefficients("a:1") is None


def test_an_endpoint_without_histograms_is_reported_once_and_when_it_recovers(caplog) -> None:
    pool = EndpointPool([Endpoint("a:1")])
    states = EndpointStates()
    learner = LatencyLearner(LatencyModel(), pool, states)
    with caplog.at_level(logging.INFO, logger="extproc.latency"):
        for _ in range(5):
            states.update("a:1", Scraped(running=1))
            learner.step()
        assert learner.missing == {"a:1"}
        assert sum("exports no latency histograms" in r.message for r in caplog.records) == 1
        states.update("a:1", Scraped(running=1, latency=Engine().totals))
        learner.step()
    assert learner.missing == set()
    assert any("now exports latency histograms" in r.message for r in caplog.records)


async def test_scraping_off_is_said_out_loud(caplog) -> None:
    learner = LatencyLearner(LatencyModel(), EndpointPool([Endpoint("a:1")]), None)
    with caplog.at_level(logging.WARNING, logger="extproc.latency"):
        await learner.run()  # returns at once: nothing to learn from
    assert not learner.scraping
    assert any("metrics scraping is off" in r.message for r in caplog.records)


def test_the_app_finds_producers_and_exports_whether_they_can_learn() -> None:
    from extproc.scheduling.plugins.latency import LatencyScorer, PredictedLatencyProducer
    from extproc.server import latency as wiring

    producer = PredictedLatencyProducer()
    plugins = [producer, LatencyScorer()]
    pool = EndpointPool([Endpoint("a:1")])
    for states, learning in ((None, 0.0), (EndpointStates(), 1.0)):
        found = wiring.learners(plugins, pool, states)
        assert [lr.model for lr in found] == [producer.model]
        values = {
            (s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in wiring.collect(found, plugins)
            for s in fam.samples
        }
        assert values[("extproc_latency_learning", ())] == learning
        assert values[("extproc_latency_predictions_total", (("source", "none"),))] == 0
    assert wiring.learners([LatencyScorer()], pool, None) == []
