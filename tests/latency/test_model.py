"""The latency model on synthetic histogram data: what it learns, how fast it follows a
server that slows down, and what it predicts with work queued."""

from __future__ import annotations

import dataclasses

import pytest

from extproc.core import EndpointState
from extproc.endpoints.exposition import LatencyTotals
from extproc.latency import LatencyModel, ModelSettings
from extproc.latency.rls import RecursiveLeastSquares
from tests.latency.synthetic import Engine, teach

IDLE = EndpointState(is_stale=False, age_s=0.0)


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_rls_recovers_a_linear_law_and_forgets_an_old_one() -> None:
    fit = RecursiveLeastSquares(2, forgetting=0.9)
    for i in range(50):
        x = (1.0 + i % 3, float(i % 7))
        fit.update(x, 2.0 * x[0] + 0.5 * x[1])
    assert fit.w == pytest.approx([2.0, 0.5], rel=1e-3)
    for i in range(40):
        x = (1.0 + i % 3, float(i % 7))
        fit.update(x, 1.0 * x[0] + 2.0 * x[1])
    assert fit.w == pytest.approx([1.0, 2.0], rel=0.03)  # the old law weighs 0.9**40
    with pytest.raises(ValueError):
        RecursiveLeastSquares(2, forgetting=0.0)


def test_learns_prefill_cost_overhead_and_itl_from_histogram_differences() -> None:
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    c = model.coefficients("a:1")
    assert c is not None
    assert c.per_token_s == pytest.approx(eng.per_token_s, rel=0.02)
    assert c.tokens_per_s == pytest.approx(5000, rel=0.02)
    assert c.per_request_s == pytest.approx(eng.per_request_s, rel=0.1)
    assert c.overhead_s == pytest.approx(eng.overhead_s, rel=0.02)
    pred = model.predict("a:1", IDLE, 2000, now=0.0)
    assert pred is not None and pred.warm
    truth = eng.overhead_s + eng.per_request_s + eng.per_token_s * 2000
    assert pred.ttft_s == pytest.approx(truth, rel=0.02)
    # TPOT with the scraped batch plus this request. Every interval had 4 running: the fit
    # cannot separate base from slope, but it is right where it was measured.
    busy = EndpointState(is_stale=False, running=3)
    pred = model.predict("a:1", busy, 0, now=0.0)
    assert pred is not None and pred.tpot_s is not None
    assert pred.tpot_s == pytest.approx(eng.itl_base_s + eng.itl_per_seq_s * 4, rel=0.01)


def test_itl_slope_is_learned_when_the_batch_varies() -> None:
    model = LatencyModel()
    eng = Engine()
    model.learn("a:1", eng.totals, 0)
    for i in range(40):
        running = [1, 8, 3, 12][i % 4]
        model.learn("a:1", eng.interval([500], running), running)
    for running in (2, 10):
        pred = model.predict("a:1", EndpointState(is_stale=False, running=running), 0, 0.0)
        assert pred is not None and pred.tpot_s is not None
        assert pred.tpot_s == pytest.approx(eng.itl_base_s + eng.itl_per_seq_s * (running + 1),
                                            rel=0.15)  # fmt: skip


def test_noisy_data_still_predicts_within_a_few_percent() -> None:
    """Each request's prefill off by up to 20%: the per-token cost (most of the time) is
    still learned closely; the small per-request part is lost in the noise, which costs
    milliseconds on short prompts."""
    model = LatencyModel()
    eng = Engine(noise=0.2)
    teach(model, "a:1", eng, intervals=80)
    for tokens in (200, 1000, 3000):
        pred = model.predict("a:1", IDLE, tokens, 0.0)
        assert pred is not None
        truth = eng.overhead_s + eng.per_request_s + eng.per_token_s * tokens
        assert pred.ttft_s == pytest.approx(truth, rel=0.08, abs=0.015)


def test_follows_a_server_that_slows_down_within_a_few_intervals() -> None:
    model = LatencyModel(ModelSettings(forgetting=0.9))
    eng = Engine()
    teach(model, "a:1", eng, intervals=40)
    eng.per_token_s *= 4  # another tenant takes three quarters of the GPU
    teach(model, "a:1", eng, intervals=5, seed=2)
    c = model.coefficients("a:1")
    assert c is not None and c.per_token_s == pytest.approx(eng.per_token_s, rel=0.1)
    assert model.stats.reopened == 1
    # Ordinary noise does not reopen the fit.
    noisy = LatencyModel()
    teach(noisy, "a:1", Engine(noise=0.2), intervals=80)
    assert noisy.stats.reopened == 0


def test_same_tokens_per_request_everywhere_still_predicts_the_mean_request() -> None:
    """Collinear features (every request 1,000 tokens): the split between per-request and
    per-token cost is unknowable, the prediction where data exists is not."""
    model = LatencyModel()
    eng = Engine()
    model.learn("a:1", eng.totals)
    for i in range(30):
        model.learn("a:1", eng.interval([1000] * (1 + i % 3)))
    c = model.coefficients("a:1")
    assert c is not None and c.per_token_s >= 0 and c.per_request_s >= 0
    pred = model.predict("a:1", IDLE, 1000, 0.0)
    assert pred is not None
    assert pred.ttft_s == pytest.approx(eng.overhead_s + eng.prefill_s(1000), rel=0.05)


def test_placed_work_queues_ahead_and_drains_with_time() -> None:
    clock = Clock()
    model = LatencyModel(clock=clock)
    eng = Engine()
    teach(model, "a:1", eng)
    alone = model.predict("a:1", IDLE, 1000, clock())
    assert alone is not None
    for _ in range(3):
        model.place("a:1", 2000, clock())
    queued = model.predict("a:1", IDLE, 1000, clock())
    assert queued is not None
    assert queued.ttft_s - alone.ttft_s == pytest.approx(3 * eng.prefill_s(2000), rel=0.05)
    clock.t += 3 * eng.prefill_s(2000) + 0.001
    later = model.predict("a:1", IDLE, 1000, clock())
    assert later is not None and later.ttft_s == pytest.approx(alone.ttft_s)


def test_scraped_waiting_counts_work_other_pickers_queued() -> None:
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    c = model.coefficients("a:1")
    assert c is not None
    alone = model.predict("a:1", IDLE, 500, 0.0)
    waiting = model.predict("a:1", EndpointState(is_stale=False, waiting=3), 500, 0.0)
    stale = model.predict("a:1", EndpointState(is_stale=True, waiting=3), 500, 0.0)
    assert alone is not None and waiting is not None and stale is not None
    assert waiting.ttft_s - alone.ttft_s == pytest.approx(3 * c.prefill_s(c.mean_tokens))
    assert stale.ttft_s == alone.ttft_s  # figures we no longer trust add nothing
    # The queue a prefill would delay: others' waiting requests, and ours placed there.
    assert (alone.queued, waiting.queued, stale.queued) == (0, 3, 0)
    assert waiting.prefill_s == pytest.approx(c.prefill_s(500))
    assert waiting.cost_s == pytest.approx(waiting.ttft_s + 3 * waiting.prefill_s)
    assert alone.cost_s == alone.ttft_s  # no queue: the cost is the wait
    model.place("a:1", 800, 0.0)
    model.place("a:1", 800, 0.0)
    ours = model.predict("a:1", EndpointState(is_stale=False, waiting=3), 500, 0.0)
    assert ours is not None and ours.queued == 3  # two ours among the three waiting
    more = model.predict("a:1", EndpointState(is_stale=False, waiting=1), 500, 0.0)
    assert more is not None and more.queued == 2  # ours count even when not yet seen


def test_unmeasured_endpoints_borrow_the_fleet_and_nothing_learned_is_none() -> None:
    model = LatencyModel()
    assert model.predict("a:1", IDLE, 100, 0.0) is None
    assert model.stats.predictions_missing == 1
    teach(model, "a:1", Engine(per_token_s=0.0001))
    teach(model, "b:1", Engine(per_token_s=0.0003))
    teach(model, "c:1", Engine(per_token_s=0.0002))
    pred = model.predict("new:1", IDLE, 1000, 0.0)
    assert pred is not None and not pred.warm
    own = model.predict("c:1", IDLE, 1000, 0.0)
    assert own is not None and own.warm and pred.ttft_s == pytest.approx(own.ttft_s, rel=0.02)
    assert model.stats.predictions_borrowed == 1 and model.stats.predictions_warm == 1
    model.retain({"a:1"})
    assert model.coefficients("b:1") is None and model.warm_endpoints == 1


def test_a_counter_reset_is_not_learned_as_negative_time() -> None:
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    before = model.coefficients("a:1")
    restarted = Engine()
    restarted.interval([100])
    assert not model.learn("a:1", restarted.totals)  # counters went down: a new baseline
    assert model.stats.resets == 1
    assert model.coefficients("a:1") == before
    assert model.learn("a:1", restarted.interval([300, 400]))


def test_needs_min_samples_and_ignores_missing_histograms() -> None:
    model = LatencyModel(ModelSettings(min_samples=5))
    eng = Engine()
    teach(model, "a:1", eng, intervals=4)
    assert model.coefficients("a:1") is None
    assert not model.learn("a:1", None)
    assert not model.learn("a:1", eng.totals)  # nothing new since the last scrape
    model.learn("a:1", eng.interval([100]))
    assert model.coefficients("a:1") is not None


def test_prefill_tokens_not_exported_falls_back_to_the_mean_request() -> None:
    model = LatencyModel()
    t = LatencyTotals()
    model.learn("a:1", t)
    for i in range(10):
        n = 1 + i % 3
        t = LatencyTotals(prefill_sum=t.prefill_sum + 0.05 * n, prefill_count=t.prefill_count + n)
        model.learn("a:1", t)
    pred = model.predict("a:1", IDLE, 12345, 0.0)
    assert pred is not None and pred.ttft_s == pytest.approx(0.05, rel=0.01)
    assert pred.tpot_s is None


def test_token_scale_learns_the_engine_tokenizer_against_the_estimate() -> None:
    """The picker's estimate says 1,000 tokens where the engine counts 2,000: predictions
    follow the engine's count once both were seen for the requests placed."""
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    before = model.predict("a:1", IDLE, 1000, 0.0)
    t = eng.totals
    for _ in range(20):
        for _ in range(3):
            model.place("a:1", 0, 0.0, prompt_tokens=1000)
        t = LatencyTotals(**{**_fields(t), "prompt_sum": t.prompt_sum + 6000,
                             "prompt_count": t.prompt_count + 3})  # fmt: skip
        model.learn("a:1", t)
    assert model.token_scale == pytest.approx(2.0, rel=0.01)
    after = model.predict("a:1", IDLE, 1000, 1e6)  # long after the placed work drained
    assert before is not None and after is not None
    c = model.coefficients("a:1")
    assert c is not None
    assert after.ttft_s - before.ttft_s == pytest.approx(c.per_token_s * 1000, rel=0.02)
    # Requests other pickers sent (nothing placed here) teach the scale nothing.
    t = LatencyTotals(
        **{**_fields(t), "prompt_sum": t.prompt_sum + 100, "prompt_count": t.prompt_count + 1}
    )
    model.learn("a:1", t)
    assert model.token_scale == pytest.approx(2.0, rel=0.01)


def _fields(t: LatencyTotals) -> dict:
    return {f.name: getattr(t, f.name) for f in dataclasses.fields(t)}


def test_own_queued_requests_in_the_scraped_waiting_count_are_not_counted_twice() -> None:
    """Placed requests not finished as of the scrape are ours, whatever the scrape says."""
    clock = Clock()
    model = LatencyModel(clock=clock)
    eng = Engine()
    teach(model, "a:1", eng)
    c = model.coefficients("a:1")
    assert c is not None
    for _ in range(3):
        model.place("a:1", 2000, clock())
    lane_only = model.predict("a:1", IDLE, 500, clock())
    # Ours, waiting (the scrape may not have seen the first start yet): nothing more.
    agrees = model.predict("a:1", EndpointState(is_stale=False, waiting=3), 500, clock())
    # Two more waiting than ours: someone else's work, at the endpoint's mean prefill each.
    more = model.predict("a:1", EndpointState(is_stale=False, waiting=5), 500, clock())
    assert lane_only is not None and agrees is not None and more is not None
    assert agrees.ttft_s == lane_only.ttft_s
    assert more.ttft_s - lane_only.ttft_s == pytest.approx(2 * c.prefill_s(c.mean_tokens))


def test_token_scale_follows_a_changed_estimate_at_once() -> None:
    """Approximate mode recalibrated (bytes per token 4 -> 1): the picker's estimates are 4x
    larger from then on. Two samples that far off replace the scale, instead of smoothing
    towards it over a dozen while every prediction is 4x off."""
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    t = eng.totals

    def sample(estimate: float, engine: float) -> None:
        nonlocal t
        model.place("a:1", 0, 0.0, prompt_tokens=estimate)
        t = LatencyTotals(**{**_fields(t), "prompt_sum": t.prompt_sum + engine,
                             "prompt_count": t.prompt_count + 1})  # fmt: skip
        model.learn("a:1", t)

    for _ in range(10):
        sample(1000, 3000)
    assert model.token_scale == pytest.approx(3.0, rel=0.05)
    sample(4000, 3000)
    assert model.token_scale == pytest.approx(3.0, rel=0.05)  # one odd sample: not yet
    sample(4000, 3000)
    assert model.token_scale == pytest.approx(0.75)
    assert model.stats.rescaled == 2  # the first from the initial 1.0, then this one


def test_token_scale_compares_the_requests_the_engine_counted_behind_a_queue() -> None:
    """A server with a queue counts a request's prompt tokens seconds after it was placed:
    each scrape's counted requests are the oldest uncounted placements, not the ones placed
    since the last scrape. With prompts of mixed sizes, comparing with the latter made the
    scale swing (3.9 -> 9.4 -> 1.5 on a constant tokenizer, bench/latency_slowdown_replay.py);
    matched in order it stays at the engine's 2 tokens per estimated token."""
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    t = eng.totals
    sizes = [1000.0, 1000.0, 4000.0, 1000.0, 250.0, 4000.0, 1000.0]
    queue = 5  # placements ahead of the one the engine counts next
    for i in range(queue):
        model.place("a:1", 0, 0.0, prompt_tokens=sizes[i % len(sizes)])
    scales = []
    for i in range(queue, queue + 40):
        model.place("a:1", 0, 0.0, prompt_tokens=sizes[i % len(sizes)])
        counted = sizes[(i - queue) % len(sizes)]  # the oldest uncounted placement
        t = LatencyTotals(**{**_fields(t), "prompt_sum": t.prompt_sum + 2 * counted,
                             "prompt_count": t.prompt_count + 1})  # fmt: skip
        model.learn("a:1", t)
        scales.append(model.token_scale)
    assert scales[-30:] == pytest.approx([2.0] * 30, rel=0.01)


def test_overhead_is_not_read_from_intervals_that_mix_requests() -> None:
    """The engine records a request's queue time when its prefill starts and its TTFT at
    the first token, often in different scrape intervals: an interval then holds one
    request's TTFT and the next one's queue wait. Compared per interval (and clipped at
    zero) that read as 100-200 ms of overhead on a busy simulated server whose true figure
    is a few ms."""
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    waits = [0.2, 1.0] * 20
    t = eng.totals
    # The first request starts its prefill (its wait recorded); then each interval ends
    # one request (TTFT, prefill) and starts the next (its wait).
    t = dataclasses.replace(t, queue_sum=t.queue_sum + waits[0], queue_count=t.queue_count + 1)
    model.learn("a:1", t)
    for wait, following in zip(waits, [*waits[1:], 0.0], strict=True):
        prefill = eng.prefill_s(1000)
        t = dataclasses.replace(
            t,
            ttft_sum=t.ttft_sum + wait + prefill + eng.overhead_s, ttft_count=t.ttft_count + 1,
            prefill_sum=t.prefill_sum + prefill, prefill_count=t.prefill_count + 1,
            prefill_tokens=(t.prefill_tokens or 0.0) + 1000,
            queue_sum=t.queue_sum + following, queue_count=t.queue_count + 1,
        )  # fmt: skip
        model.learn("a:1", t)
    c = model.coefficients("a:1")
    assert c is not None and c.overhead_s == pytest.approx(eng.overhead_s, abs=0.002)


def test_one_whole_prefill_far_off_the_fit_rescales_it_at_once() -> None:
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    eng.per_request_s *= 3
    eng.per_token_s *= 3  # another tenant: every term three times slower
    model.learn("a:1", eng.interval([1500]))
    c = model.coefficients("a:1")
    assert c is not None
    assert c.prefill_s(1500) == pytest.approx(eng.prefill_s(1500), rel=0.05)
    assert model.stats.rescaled_speed == 1


def test_after_a_prefill_that_straddled_a_slowdown_the_fit_catches_up_quickly() -> None:
    """The first slowed prefill to end began before the slowdown: the rescale it triggers
    takes only part of the change. The one-request intervals after it cannot separate the
    fit's two terms, so the published fit often falls back to the smoothed means, which
    must follow the rescale too (left alone they kept the old speed for ~5 intervals: the
    fit predicted 24%, 20%, 14% low on the 2nd to 4th slowed prefill)."""
    model = LatencyModel()
    eng = Engine()
    teach(model, "a:1", eng)
    # Slowed to 0.3 a third of the way into a 1,400-token prefill.
    straddle = eng.prefill_s(1400) * (1 / 3 + (2 / 3) / 0.3)
    eng.per_request_s /= 0.3
    eng.per_token_s /= 0.3
    t = eng.totals
    eng.totals = dataclasses.replace(
        t,
        ttft_sum=t.ttft_sum + straddle + eng.overhead_s,
        ttft_count=t.ttft_count + 1,
        queue_count=t.queue_count + 1,
        prefill_sum=t.prefill_sum + straddle,
        prefill_count=t.prefill_count + 1,
        prefill_tokens=(t.prefill_tokens or 0.0) + 1400,
    )
    model.learn("a:1", eng.totals)
    assert model.stats.rescaled_speed == 1
    ratios = []
    for tokens in (1400, 1350, 5800, 1400, 1300):
        model.learn("a:1", eng.interval([tokens]))
        c = model.coefficients("a:1")
        assert c is not None
        ratios.append(c.prefill_s(1400) / eng.prefill_s(1400))
    assert all(r > 0.9 for r in ratios[1:]), ratios
