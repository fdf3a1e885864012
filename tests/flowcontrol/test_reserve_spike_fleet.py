"""The spike term on active-active replicas (flowcontrol/reserve.py, shared.py): each replica
sees only its share of a band's arrivals, so sized from its own its spike term was a
fraction of one picker's (0.3-1.5k tokens against 1.2-2.6k in the overload bench's
arrivals); the peers' arrivals, exchanged through Redis, make it the fleet's."""

from __future__ import annotations

import random

from extproc.flowcontrol.reserve import OWN_KEPT, PEER_BANDS, QUANTILE_TRUSTED, Reserve
from extproc.flowcontrol.shared import SharedFlowState
from tests.flowcontrol.test_controller import make
from tests.flowcontrol.test_reserve_rate import Clock
from tests.redis_servers import RedisServer

# A band's arrivals: (seconds from the start, tokens); clumps of two or three close together.
ARRIVALS = [
    (i * 1.0 + dt, tokens)
    for i in range(QUANTILE_TRUSTED)
    for dt, tokens in ((0.0, 1000), (0.1, 500), (0.15, 300))[: 2 + i % 2]
]


def test_a_peers_arrivals_count_as_the_replicas_own():
    one_clock, clocks = Clock(), (Clock(), Clock())
    one = Reserve(1, one_clock, spike_s=0.3)
    pair = [Reserve(1, c, spike_s=0.3) for c in clocks]
    for n, (at, tokens) in enumerate(ARRIVALS):
        one_clock.now = clocks[0].now = clocks[1].now = 100.0 + at
        one.note(10, tokens, 0)
        pair[n % 2].note(10, tokens, 0)  # Envoy alternates the replicas
    alone = [r.spike(10) for r in pair]
    # Over 0.3 s before each: nothing (20 times), 1,000 (20), 1,500 (10); p90 1,500.
    assert one.spike(10) == 1500 and max(alone) < 1500
    # Each hears of the other's arrivals late, after its own later ones: ordered by time.
    for mine, theirs in ((pair[0], pair[1]), (pair[1], pair[0])):
        got, short = theirs.own_arrivals(0.0, 0)
        assert not short and len(got) == len(ARRIVALS) // 2
        for _seq, band, at, tokens in got:
            mine.peer_arrived(band, at, tokens)
    assert [r.spike(10) for r in pair] == [1500, 1500]
    assert pair[0].spike_history(10) == min(100, len(ARRIVALS))


def test_a_peers_arrivals_of_endless_bands_are_refused_past_a_bound():
    # A forged or broken peer naming a new band in every arrival must not grow the
    # per-band arrivals without bound; the bands already kept go on taking them.
    r = Reserve(1, Clock(), spike_s=0.3)
    taken = [r.peer_arrived(band, 1.0, 100) for band in range(PEER_BANDS + 10)]
    assert taken == [True] * PEER_BANDS + [False] * 10
    assert r.peer_arrived(0, 1.1, 100)
    assert r.spike_history(0) == 2


def test_only_the_bands_above_the_lowest_and_the_window_are_published():
    clock = Clock()
    r = Reserve(1, clock, spike_s=0.3)
    for band in (0, 10):
        r.note(band, 100, 0)
        clock.now += 1.0
    assert [a[1:] for a in r.own_arrivals(0.0, 0)[0]] == [(10, 101.0, 100)]
    assert r.own_arrivals(101.5, 0) == ([], False)
    assert Reserve(1, clock).own_arrivals(0.0, 0) == ([], False)  # no spike window: none kept
    for _ in range(OWN_KEPT + 1):  # more than kept within the window: said
        r.note(10, 100, 0)
    got, short = r.own_arrivals(clock.now, 0)
    assert short and len(got) == OWN_KEPT


async def test_replicas_exchange_their_arrivals_through_redis(redis_server: RedisServer):
    a, _, clock_a = make(capacity=4)
    b, _, clock_b = make(capacity=4)
    clock_b.t += 5000.0  # each replica's own clock: times travel on Redis's
    for fc, clock in ((a, clock_a), (b, clock_b)):
        fc.reserve_count = 1
        fc.reserve = Reserve(1, clock, spike_s=0.3)
        fc.reserve.note(0, 100, 0)  # a lower band: the band above it is published
    kw = {"namespace": "spike", "interval_s": 100.0}  # every arrival within the horizon
    sa = SharedFlowState.from_url(redis_server.url, a, process_id="a", **kw)
    sb = SharedFlowState.from_url(redis_server.url, b, process_id="b", **kw)
    try:
        one = Reserve(1, Clock(), spike_s=0.3)
        start_a, start_b = clock_a.t, clock_b.t
        for n, (at, tokens) in enumerate(ARRIVALS):
            clock_a.t, clock_b.t = start_a + at, start_b + at
            one._clock.now = at  # type: ignore[attr-defined]
            one.note(10, tokens, 0)
            (a, b)[n % 2].reserve.note(10, tokens, 0)
        # The first exchange reads Redis's clock (the fake clocks stood still, so after
        # their jump above, not before): arrivals go from the next one on.
        await sa.exchange()
        await sb.exchange()
        for _ in range(2):  # repeated: nothing counted twice
            await sa.exchange()
            await sb.exchange()
            await sa.exchange()
        assert a.reserve.spike_history(10) == b.reserve.spike_history(10) == len(ARRIVALS)
        assert a.reserve.spike(10) == b.reserve.spike(10) == one.spike(10) == 1500
        assert sa.stats.bad_entries == sb.stats.bad_entries == 0
        # a restarts under the same id (its arrivals numbered from 1 again): still counted
        a.reserve = Reserve(1, clock_a, spike_s=0.3)
        a.reserve.note(0, 100, 0)
        a.reserve.note(10, 700, 0)
        await sa.exchange()
        await sb.exchange()
        assert b.reserve.spike_history(10) == len(ARRIVALS) + 1
    finally:
        await sa.aclose()
        await sb.aclose()


def test_the_term_is_the_quantile_over_the_last_history_whatever_order_they_came_in():
    """Against a plain count: random arrivals, a third of them heard late from a peer."""
    rng = random.Random(7)
    clock = Clock()
    r = Reserve(1, clock, spike_s=0.3, spike_quantile=0.8)
    arrivals, late = [], []
    at = 100.0
    for _ in range(250):
        at += rng.expovariate(5.0)
        tokens = rng.choice((500, 1300, 2600))
        arrivals.append((at, tokens))
        if rng.random() < 1 / 3:
            late.append((at, tokens))
        else:
            clock.now = at
            r.note(10, tokens, 0)
        if len(late) > 3:  # heard a few arrivals later
            for a, t in late:
                r.peer_arrived(10, a, t)
            late = []
    for a, t in late:
        r.peer_arrived(10, a, t)
    recent = arrivals[-100:]
    aheads = sorted(sum(t for b, t in arrivals if a - 0.3 < b < a) for a, _ in recent)
    assert r.spike(10) == aheads[79]
