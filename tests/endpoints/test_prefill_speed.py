"""The prefill speed estimate: from the engine's prefill histograms where exported (queueing
excluded, so identical servers read alike whatever their queues), else from time to first
byte in the access log, which says so."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass

from extproc.core import LatencyTotals
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.sim.steps import ChunkPolicy, Work, plan_step


class Clock:
    """Wall time the engines below advance as they prefill."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Engine:
    """Cumulative prefill histograms of one simulated engine: prefills run one at a time at
    `tps`, each with a fixed step overhead, advancing `clock` (its own by default)."""

    def __init__(self, tps: float, overhead_s: float = 0.0005, clock: Clock | None = None) -> None:
        self.tps, self.overhead = tps, overhead_s
        self.clock = clock or Clock()
        self.tokens = self.seconds = self.count = 0.0

    def prefill(self, tokens: int) -> float:
        """Runs one prefill; returns its duration."""
        s = self.overhead + tokens / self.tps
        self.clock.now += s
        self.tokens += tokens
        self.seconds += s
        self.count += 1
        return s

    def totals(self) -> LatencyTotals:
        return LatencyTotals(
            prefill_sum=self.seconds, prefill_count=self.count, prefill_tokens=self.tokens
        )


def test_identical_servers_read_alike_whatever_their_queues():
    # Two servers at 20,000 tok/s; `a` is the one predicted TTFT favoured, so its requests
    # queued behind each other: time to first byte 1-8x the prefill. Issue 14: the access
    # log alone read identical servers 4x apart.
    clock = Clock()
    sp = PrefillSpeeds(clock=clock)
    a, b = Engine(20000, clock=clock), Engine(20000, clock=clock)
    for name, e in (("a", a), ("b", b)):
        sp.scraped(name, e.totals())  # the baseline scrape
    for i in range(40):
        tokens = 1000 + 97 * (i % 7)
        for name, e, queued in (("a", a, 1 + i % 8), ("b", b, 1)):
            s = e.prefill(tokens)
            sp.observe(name, tokens, s * queued)  # the access log's sample: queueing in
            if i % 3 == 2:
                sp.scraped(name, e.totals())
    ra, rb = sp.get("a"), sp.get("b")
    assert ra is not None and rb is not None
    assert abs(ra / rb - 1) < 0.02, (ra, rb)
    assert 0.9 * 20000 < ra < 20000  # the step overhead only
    assert sp.sources() == {"engine": 2, "access_log": 0}


def test_a_slower_server_reads_slower_and_a_changed_one_follows_within_the_window():
    clock = Clock()
    sp = PrefillSpeeds(clock=clock)
    fast, slow = Engine(20000, clock=clock), Engine(5000, clock=clock)
    for name, e in (("fast", fast), ("slow", slow)):
        sp.scraped(name, e.totals())
        for _ in range(5):
            e.prefill(2000)
            sp.scraped(name, e.totals())
    assert sp.get("fast") / sp.get("slow") > 3.5  # type: ignore[operator]
    slow.tps = 20000  # another tenant left the GPU
    for _ in range(40):
        slow.prefill(2000)
        sp.scraped("slow", slow.totals())
    assert abs(sp.get("slow") / sp.get("fast") - 1) < 0.02  # type: ignore[operator]


def test_overhead_only_intervals_and_restarts_teach_nothing_wrong():
    clock = Clock()
    sp = PrefillSpeeds(clock=clock)
    e = Engine(20000, overhead_s=0.01, clock=clock)
    sp.scraped("a", e.totals())
    e.prefill(16)  # a fully cached prompt's last block: all overhead
    sp.scraped("a", e.totals())
    assert sp.get("a") is None and sp.samples == 0
    e.prefill(4000)
    sp.scraped("a", e.totals())
    learned = sp.get("a")
    assert learned is not None and learned > 10000
    # A new engine process: counters restart from 0. The old window goes, the drop is no
    # sample, and the next interval is measured from the new baseline.
    fresh = Engine(5000, clock=clock)
    sp.scraped("a", fresh.totals())
    assert sp.snapshot() == {}
    fresh.prefill(4000)
    sp.scraped("a", fresh.totals())
    assert abs(sp.get("a") / 5000 - 1) < 0.01  # type: ignore[operator]


def test_without_histograms_the_access_log_speaks_and_says_so(caplog):
    clock = Clock()
    sp = PrefillSpeeds(clock=clock)
    with caplog.at_level(logging.WARNING):
        sp.scraped("old", None)
        sp.scraped("old", LatencyTotals(prefill_sum=1.0, prefill_count=2.0))  # no token sum
    assert sum("exports no prefill" in r.getMessage() for r in caplog.records) == 1
    sp.observe("old", 5000, 1.0)
    assert sp.get("old") == 5000
    e = Engine(20000, clock=clock)
    sp.scraped("new", e.totals())
    e.prefill(3000)
    sp.scraped("new", e.totals())
    assert sp.sources() == {"engine": 1, "access_log": 1}
    # Estimates changed unit: the access log's samples follow, the engine's count its own
    # tokens and stay.
    before = sp.get("new")
    sp.units_changed(2.0)
    assert sp.get("old") == 10000 and sp.get("new") == before
    sp.forget("new")
    assert sp.get("new") == 10000  # the fleet's median, of what is left


def test_tokens_and_seconds_counted_in_different_scrapes_still_meet():
    # vLLM may count a request's computed tokens (by source) at its first token and observe
    # its prefill time when it finishes: an interval with tokens and no seconds, then one
    # with seconds and no tokens. Neither alone is a speed; together they are the right one.
    clock = Clock()
    sp = PrefillSpeeds(clock=clock)
    tokens = seconds = count = 0.0
    sp.scraped("a", LatencyTotals(prefill_sum=0.0, prefill_count=0.0, prefill_tokens=0.0))
    for _ in range(10):
        tokens += 2000
        sp.scraped(
            "a", LatencyTotals(prefill_sum=seconds, prefill_count=count, prefill_tokens=tokens)
        )
        seconds += 0.1
        count += 1
        clock.now += 0.1
        sp.scraped(
            "a", LatencyTotals(prefill_sum=seconds, prefill_count=count, prefill_tokens=tokens)
        )
    assert abs(sp.get("a") / 20000 - 1) < 0.01  # type: ignore[operator]


def test_the_fastest_speed_is_the_engines_where_one_exports_it():
    # Flow control's reserve sizes a prefill's time by `fastest`: an access-log sample is
    # queueing plus prefill, so the engine's own figure, where there is one, wins over it.
    clock = Clock()
    sp = PrefillSpeeds(clock=clock)
    sp.add("a", 50_000.0)  # a sample the access log overestimated (the index under-credited)
    assert sp.fastest() == 50_000.0
    engine = Engine(8000, clock=clock)
    sp.scraped("b", engine.totals())
    for _ in range(4):
        engine.prefill(4000)
    sp.scraped("b", engine.totals())
    assert sp.fastest() is not None and 7000 < sp.fastest() < 8000


# Engine steps as vLLM 0.32 runs them (the simulator's planner: a token budget per step,
# prefills under way first, chunked), on a virtual clock, scraped like the picker scrapes.


@dataclass
class Req:
    tokens: int
    arrive: float
    decode_s: float = 0.002
    start: float | None = None  # first scheduled step
    first: float | None = None  # first token: the end of its last prefill step
    computed: int = 0

    @property
    def done(self) -> float:
        assert self.first is not None
        return self.first + self.decode_s


def run_steps(reqs: list[Req], tps: float = 20000, overhead_s: float = 0.0005) -> float:
    """Runs every prefill in engine steps of 2048 tokens at `tps`; returns the busy seconds."""
    policy = ChunkPolicy()
    t = busy = 0.0
    left = sorted(reqs, key=lambda r: r.arrive)
    running: list[Req] = []
    waiting: list[Req] = []
    while left or running or waiting:
        while left and left[0].arrive <= t:
            waiting.append(left.pop(0))
        if not (running or waiting):
            t = left[0].arrive
            continue
        plan = plan_step(
            policy,
            [Work(r, r.tokens - r.computed) for r in running],
            [Work(r, r.tokens) for r in waiting],
            0,
            len(running) + len(waiting),
        )
        step = overhead_s + sum(w.left for w in plan) / tps
        for w in plan:
            if w.item.start is None:
                w.item.start = t
                waiting.remove(w.item)
                running.append(w.item)
        t += step
        busy += step
        for w in plan:
            w.item.computed += w.left
            if w.item.computed >= w.item.tokens:
                w.item.first = t
                running.remove(w.item)
    return busy


def scrape_along(sp: PrefillSpeeds, clock: Clock, reqs: list[Req], every_s: float = 0.05) -> None:
    """Scrapes every `every_s` until all have finished: vLLM's totals, each request's
    phases observed when it finishes."""
    end = max(r.done for r in reqs) + 2 * every_s
    clock.now = 0.0
    while clock.now <= end:
        done = [r for r in reqs if r.done <= clock.now]
        sp.scraped(
            "a",
            LatencyTotals(
                prefill_sum=sum(r.first - r.start for r in done),  # type: ignore[operator]
                prefill_count=len(done),
                decode_sum=sum(r.decode_s for r in done),
                decode_count=len(done),
                prefill_tokens=sum(r.tokens for r in done),
            ),
        )
        clock.now += every_s


def both(reqs: list[Req]) -> tuple[float, float, float, float]:
    """(true engine speed, busy estimate, request estimate, overlap) for `reqs`."""
    busy_s = run_steps(reqs)
    true = sum(r.tokens for r in reqs) / busy_s
    out = []
    for estimator in ("busy", "request"):
        clock = Clock()
        sp = PrefillSpeeds(estimator, clock=clock)  # type: ignore[arg-type]
        scrape_along(sp, clock, [dataclasses.replace(r) for r in reqs])
        speed = sp.get("a")
        assert speed is not None
        out.append(speed)
    return true, out[0], out[1], sp.overlaps()["a"]


def test_idle_engine_both_estimators_read_its_speed():
    # One prefill at a time, long decodes (observed at the finish, a second later).
    reqs = [Req(1500 + 100 * (i % 5), arrive=0.3 * i, decode_s=1.0) for i in range(20)]
    true, busy, request, overlap = both(reqs)
    assert abs(busy / true - 1) < 0.02 and abs(request / true - 1) < 0.02, (true, busy, request)
    assert overlap < 1.02


def test_prefills_sharing_one_step_count_its_time_once():
    # Bursts of 8 prompts of 250 tokens: each burst is one 2,000-token step, and each of the 8
    # requests' prefill time is that whole step.
    reqs = [Req(250, arrive=0.5 * (i // 8)) for i in range(8 * 12)]
    true, busy, request, overlap = both(reqs)
    assert request < 0.2 * true, (true, request)  # the old reading: 1/8
    # The scrape interval (50 ms) is the resolution: a 0.1 s step reads up to ~1.5x long.
    assert 0.6 * true < busy <= 1.02 * true, (true, busy)
    assert overlap > 5


def test_a_queue_of_chunked_prefills_reads_the_engine_speed():
    # 12 prompts of ~2,000 tokens at once (tests/e2e/test_prefill_speed.py's burst): each
    # spans two 2,048-token steps, sharing both, so per request the engine looks half as
    # fast; in busy seconds it is the same engine as when idle.
    reqs = [Req(1900 + 20 * i, arrive=0.0001 * i, decode_s=0.01) for i in range(12)]
    reqs += [Req(1900 + 20 * i, arrive=5 + 0.0001 * i, decode_s=0.3) for i in range(12)]
    true, busy, request, overlap = both(reqs)
    assert request < 0.6 * true, (true, request)
    assert abs(busy / true - 1) < 0.1, (true, busy)
    assert 1.7 < overlap < 2.3


def test_a_long_prompt_chunked_across_steps_alone_reads_the_engine_speed():
    reqs = [Req(7000, arrive=2.0 * i, decode_s=0.5) for i in range(6)]
    true, busy, request, _ = both(reqs)
    assert abs(busy / true - 1) < 0.02 and abs(request / true - 1) < 0.02, (true, busy, request)


def test_the_estimator_in_use_is_logged_once(caplog):
    clock = Clock()
    sp = PrefillSpeeds("request", clock=clock)
    e = Engine(20000, clock=clock)
    with caplog.at_level(logging.INFO):
        sp.scraped("a", e.totals())
        for _ in range(3):
            e.prefill(3000)
            sp.scraped("a", e.totals())
    said = [r.getMessage() for r in caplog.records if "prefill speed from" in r.getMessage()]
    assert len(said) == 1 and "request estimator" in said[0], said
