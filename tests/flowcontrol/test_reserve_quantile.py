"""The reserve sized from a quantile of a higher band's recent requests
(`flow_control.reserve_quantile`) instead of its largest: a rare large request no longer
sets the room every lower-band request must leave free, and the band's own history is
trusted from `QUANTILE_TRUSTED` requests (until then the prior, a largest, counts)."""

from __future__ import annotations

import asyncio
import logging

import pytest

from extproc.config import decode_settings
from extproc.errors import ConfigError
from extproc.flowcontrol.controller import FlowRequest
from extproc.flowcontrol.reserve import QUANTILE_TRUSTED, BandPrior, Reserve
from tests.flowcontrol.test_reserve_rate import Clock, Fleet, make, settle


def _feed(r: Reserve, clock: Clock, sizes: list[tuple[int, int]]) -> None:
    for tokens, output in sizes:
        clock.now += 1.0
        r.note(10, tokens, output)


def test_the_quantile_not_the_largest_sizes_the_reserve():
    # 18 requests of 500 (400 prompt), 2 of 3000 (2900 prompt): p90 is a 500 one.
    sizes = [(500, 100)] * 18 + [(3000, 100)] * 2
    clock = Clock()
    largest = Reserve(1, clock)
    _feed(largest, clock, sizes)
    clock = Clock()
    q90 = Reserve(1, clock, quantile=0.9)
    _feed(q90, clock, sizes)
    assert largest.held(0, (10, 0), None)[0] == 3000
    assert q90.held(0, (10, 0), None)[0] == 500
    # The rate term uses the quantile's prompt: 19 x ... over 19 s; tokens after the first
    # (500 x 17 + 3000 x 2 = 14500) over 19 s, times 400 / 1000 tokens/s.
    rate = q90.rate(10)
    assert q90.held(0, (10, 0), 1000.0)[0] == 500 + int(rate * 400 / 1000.0)
    assert largest.held(0, (10, 0), 1000.0)[0] == 3000 + int(rate * 2900 / 1000.0)
    # At p95 and above the large ones count (nearest rank: the 19th of 20).
    clock = Clock()
    q95 = Reserve(1, clock, quantile=0.95)
    _feed(q95, clock, sizes)
    assert q95.held(0, (10, 0), None)[0] == 3000
    # `count` requests' room: twice the quantile's size.
    clock = Clock()
    two = Reserve(2, clock, quantile=0.9)
    _feed(two, clock, sizes)
    assert two.held(0, (10, 0), None)[0] == 1000


def test_the_prior_counts_until_the_quantile_has_enough_history(caplog):
    caplog.set_level(logging.INFO, "extproc.flowcontrol")
    clock = Clock()
    r = Reserve(1, clock, {10: BandPrior(tokens=2700, prompt=2500)}, quantile=0.9)
    _feed(r, clock, [(500, 100)] * (QUANTILE_TRUSTED - 1))
    assert r.held(0, (10, 0), None)[0] == 2700
    assert r.on_prior[10]
    _feed(r, clock, [(500, 100)])
    assert r.held(0, (10, 0), None)[0] == 500
    assert r.on_prior[10] is False
    assert f"now sized from measured history alone ({QUANTILE_TRUSTED} requests)" in caplog.text
    # Without a quantile the same history is not trusted yet (HISTORY = 100).
    clock = Clock()
    r = Reserve(1, clock, {10: BandPrior(tokens=2700, prompt=2500)})
    _feed(r, clock, [(500, 100)] * QUANTILE_TRUSTED)
    assert r.held(0, (10, 0), None)[0] == 2700


def test_a_quantile_outside_0_1_is_refused():
    with pytest.raises(ValueError):
        Reserve(1, Clock(), quantile=1.0)
    with pytest.raises(ConfigError, match="reserve_quantile"):
        decode_settings({"flow_control": {"reserve_quantile": 1.0}})
    cfg = decode_settings({"flow_control": {"reserve_quantile": 0.9}})
    assert cfg.flow_control is not None and cfg.flow_control.reserve_quantile == 0.9


async def test_a_lower_band_request_fits_beside_the_quantile_not_the_largest():
    # Cap 2000 per endpoint; A holds 800, B 600. Interactive sent mostly 500-token requests
    # and two of 1800. Keeping room for the largest (1800) nowhere fits after a 300-token
    # batch request (A: 800 + 300 + 1800, B: 600 + 300 + 1800 > 2000): held. Keeping room
    # for the p90 (500) it goes.
    sizes = [(500, 0)] * 18 + [(1800, 0)] * 2
    for quantile, goes in ((0.0, False), (0.9, True)):
        fleet = Fleet(tps=None, A=800, B=600)
        clock = Clock()
        ctl = make(fleet, cap=2000, output=0, reserve=1, clock=clock)
        ctl.reserve = Reserve(1, clock, quantile=quantile)
        _feed(ctl.reserve, clock, sizes)
        task = asyncio.create_task(ctl.admit(FlowRequest("t", 0, 300, 10)))
        await settle()
        assert task.done() is goes, quantile
        if goes:
            ctl.release(task.result())
        else:
            task.cancel()
            assert ctl.reserve_held >= 1


def test_the_rate_quantile_shortens_only_the_rate_terms_window():
    # 18 requests of 500 (400 prompt), 2 of 3000 (2900 prompt); prefill 1000 tokens/s.
    sizes = [(500, 100)] * 18 + [(3000, 100)] * 2
    clock = Clock()
    r = Reserve(1, clock, rate_quantile=0.5)
    _feed(r, clock, sizes)
    rate = r.rate(10)
    # The largest still sets the size term; the rate term counts a median prompt's prefill.
    assert r.held(0, (10, 0), 1000.0)[0] == 3000 + int(rate * 400 / 1000.0)
    # Before QUANTILE_TRUSTED requests: the largest's (here the prior's) prompt.
    clock = Clock()
    prior = {10: BandPrior(tokens=3000, prompt=2900, rate=100.0)}
    r = Reserve(1, clock, prior, rate_quantile=0.5)
    _feed(r, clock, sizes[: QUANTILE_TRUSTED - 1])
    assert r.held(0, (10, 0), 1000.0)[0] == 3000 + int(max(r.rate(10), 100.0) * 2900 / 1000.0)
    with pytest.raises(ValueError):
        Reserve(1, Clock(), rate_quantile=-0.1)
    cfg = decode_settings({"flow_control": {"reserve_rate_quantile": 0.5}})
    assert cfg.flow_control is not None and cfg.flow_control.reserve_rate_quantile == 0.5


def test_the_ordered_history_reads_the_quantiles_a_sort_would():
    # The band's history is kept in order as requests come and go (past HISTORY the oldest
    # leave); its quantiles and every band's together are the ones sorting gives.
    import random

    from extproc.flowcontrol.reserve import HISTORY, _rank

    rng = random.Random(3)
    clock = Clock()
    r = Reserve(2, clock, quantile=0.8, rate_quantile=0.5)
    noted: dict[int, list[tuple[int, int]]] = {5: [], 10: []}
    for _ in range(3 * HISTORY):
        band = rng.choice((5, 10))
        tokens = rng.randrange(50, 3000)
        output = rng.randrange(0, 200)
        clock.now += 0.1
        r.note(band, tokens, output)
        noted[band] = (noted[band] + [(tokens, max(0, tokens - output))])[-HISTORY:]
        for b, hist in noted.items():
            if not hist:
                continue
            sizes = sorted(t for t, _ in hist)
            prompts = sorted(p for _, p in hist)
            if b == band:
                assert r._largest[b] == (2 * sizes[_rank(0.8, len(sizes))],
                                         prompts[_rank(0.8, len(prompts))])  # fmt: skip
                assert r._rate_prompt[b] == prompts[_rank(0.5, len(prompts))]
        every = [h for hist in noted.values() for h in hist]
        sizes = sorted(t for t, _ in every)
        prompts = sorted(p for _, p in every)
        rank = _rank(0.8, len(every))
        assert r._largest_any == (2 * sizes[rank], prompts[rank])
