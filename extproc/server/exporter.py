"""The picker's own metric families, read from its parts at every scrape.

Stats dataclass fields go through their tables (server/families.py), so a field cannot be
forgotten; what is not a stats field (per-endpoint figures, readiness, signals, the KV-event
silence clock) is written out here. docs/operations.md lists every metric.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from prometheus_client.core import Metric

from extproc.endpoints.shared_inflight import SharedInFlight
from extproc.index.silence import SilenceWatch
from extproc.scheduling.plugins.sessions import BoundedSessionsFilter
from extproc.server import families as fam
from extproc.server import latency as latency_wiring
from extproc.server.assembly import Parts
from extproc.server.families import chain, one
from extproc.server.metrics import counter, gauge
from extproc.server.shared_placements import SharedPlacements


class _SharedChannel(Protocol):
    """What every Redis-backed sharing loop shows the exporter."""

    @property
    def stats(self) -> object: ...
    @property
    def is_degraded(self) -> bool: ...


def _shared(
    table: fam.StatsFamilies, channel: _SharedChannel, degraded: str, why: str
) -> Iterator[Metric]:
    """A sharing loop's counters and its degraded gauge; `why` says what the replica does
    meanwhile (each loop falls back differently)."""
    yield from table.families(channel.stats)
    yield one(degraded, why, 1.0 if channel.is_degraded else 0.0)


def register(
    parts: Parts,
    ready: Callable[[], bool],
    kube_watches: dict[str, object],
    running: Sequence[tuple[fam.StatsFamilies, Any]] = (),
) -> None:
    """Add every component's collector to the process's registry. `running`: the stats of
    what the process starts beside the parts (its loops, a file watch), each with its table;
    read at every scrape, so entries appended later show too."""
    m = parts.metrics
    m.add_collector(Exporter(parts, ready, kube_watches).collect)
    m.add_collector(lambda: chain(*(table.families(stats) for table, stats in running)))
    if parts.latency:
        plugins = parts.router.scheduler.plugins
        m.add_collector(lambda: latency_wiring.collect(parts.latency, plugins))
    if parts.admission is not None:
        admission = parts.admission
        m.add_collector(admission.collect)
        m.add_collector(lambda: fam.FLOW.families(admission.controller.stats))
        if admission.shared is not None:
            shared = admission.shared
            m.add_collector(lambda: fam.SHARED_FLOW.families(shared.stats))


class Exporter:
    def __init__(
        self, parts: Parts, ready: Callable[[], bool], kube_watches: dict[str, object]
    ) -> None:
        self._p = parts
        self._ready = ready
        self._kube = kube_watches
        # Time of the last KV-event message seen at a scrape (the silence gauge's reference).
        self._kv_seen = (0, time.monotonic())

    def collect(self) -> Iterator[Metric]:
        p = self._p
        sig = gauge(
            "extproc_scheduling_signal",
            "1 for each live signal that feeds scheduling in this process, 0 when off.",
            ["signal"],
        )
        for name, on in p.signals.as_dict().items():
            sig.add_metric([name], 1.0 if on else 0.0)
        yield sig
        yield from fam.CALIBRATION.families(p.calibration.stats)
        if (capacity := p.router.capacity_stats) is not None:
            yield from fam.CAPACITY.families(capacity)
        if p.router.placed is not None:
            yield from fam.PLACED.families(p.router.placed.stats)
        r = p.router.stats
        yield from fam.ROUTER.families(r)
        faults = counter(
            "extproc_plugin_faults",
            "Scores refused from a scorer (wrong count, NaN, out of [0, 1], or raised); "
            "the scorer is left out of that decision.",
            ["plugin"],
        )
        for profile in p.router.scheduler.profiles.values():
            for plugin, n in profile.faults.counts.items():
                faults.add_metric([plugin], n)
        yield faults
        g = gauge("extproc_inflight_requests", "Requests in flight per endpoint.", ["endpoint"])
        t = gauge("extproc_inflight_tokens", "Estimated in-flight prompt tokens.", ["endpoint"])
        for e in p.pool.snapshot():
            g.add_metric([e.address], p.router.inflight.requests(e.address))
            t.add_metric([e.address], p.router.inflight.tokens(e.address))
        yield g
        yield t
        yield from self._request_ends()
        yield one("extproc_endpoints", "Endpoints in the pool.", len(p.pool))
        if p.dcgm is not None:
            yield from fam.DCGM.families(p.dcgm.stats)
        yield one(
            "extproc_llmd_degraded",
            "Parts of the llm-d config running with less than asked for (see the start-up log).",
            len(p.settings.degraded),
        )
        yield one(
            "extproc_ready",
            "1 while the picker reports SERVING (endpoints known, not draining).",
            1.0 if self._ready() else 0.0,
        )
        if r.prefix_blocks_requested:
            # Since start; for a window use the PromQL in docs/operations.md.
            yield one(
                "extproc_prefix_hit_ratio",
                "Matched / requested prefix blocks since start (tier-weighted).",
                r.prefix_blocks_matched / r.prefix_blocks_requested,
            )
        yield from self._endpoints()
        if p.index is not None:
            yield from fam.INDEX.families(p.index.stats)
        if isinstance(p.inflight, SharedInFlight):
            yield from _shared(
                fam.SHARED_INFLIGHT,
                p.inflight,
                "extproc_shared_inflight_degraded",
                "1 while peers' in-flight counts are unknown (Redis failing): local counts only.",
            )
        if p.inflight_push is not None:
            yield from _shared(
                fam.INFLIGHT_PUSH,
                p.inflight_push,
                "extproc_inflight_push_degraded",
                "1 while placements are not pushed (Redis failing): the peers' placements "
                "come with the shared in-flight exchange alone.",
            )
        if p.shared_sessions is not None:
            yield from _shared(
                fam.SHARED_SESSIONS,
                p.shared_sessions,
                "extproc_shared_sessions_degraded",
                "1 while the live-session record is not shared (Redis failing): new sessions "
                "are bounded by this replica's own placements.",
            )
            yield one(
                "extproc_shared_sessions_live",
                "Live sessions in this replica's record (every replica's placements).",
                p.shared_sessions.live,
            )
        if p.shared_growth is not None:
            yield from _shared(
                fam.SHARED_GROWTH,
                p.shared_growth,
                "extproc_shared_growth_degraded",
                "1 while learned session growth is not shared (Redis failing): "
                "bounded-sessions-filter learns from this replica's placements only.",
            )
        if p.shared_observations is not None:
            yield from _shared(
                fam.SHARED_OBSERVATIONS,
                p.shared_observations,
                "extproc_shared_observations_degraded",
                "1 while prefill-speed samples and new-prefix picks are not shared (Redis "
                "failing): this replica learns from its own placements only.",
            )
        if p.shared_scrapes is not None:
            yield from _shared(
                fam.SHARED_SCRAPES,
                p.shared_scrapes,
                "extproc_shared_scrapes_degraded",
                "1 while scrapes are not shared (Redis failing): this replica scrapes every "
                "server itself.",
            )
        if p.shared_calibration is not None:
            yield from _shared(
                fam.SHARED_CALIBRATION,
                p.shared_calibration,
                "extproc_shared_calibration_degraded",
                "1 while calibration is not pooled (Redis failing): approximate keys "
                "calibrate from this replica's placements only.",
            )
        if p.shared_placements is not None:
            yield from _shared(
                fam.SHARED_PLACEMENTS,
                p.shared_placements,
                "extproc_shared_placements_degraded",
                "1 while placements are not shared (Redis failing): predicted TTFT's prefill "
                "queues and written tokens count this replica's placements only.",
            )
        if p.shared_silence is not None:
            yield from _shared(
                fam.SHARED_SILENCE,
                p.shared_silence,
                "extproc_kv_events_silence_fleet_degraded",
                "1 while the replicas' heard counts or placements do not arrive (Redis "
                "failing, or a live peer that shares none): KV-event silence is judged from "
                "this replica's own placements and publishers.",
            )
        yield from self._ttft_views()
        # Named by their order among the scheduler's plugins, as predicted-TTFT's views are.
        bounds = [x for x in p.router.scheduler.plugins if isinstance(x, BoundedSessionsFilter)]
        if bounds:
            names = [str(i) for i in range(len(bounds))]
            yield from fam.SESSION_BOUND.families_of([b.stats for b in bounds], "filter", names)
        if p.subscriber is not None:
            yield from self._kv_events()
        if self._kube:
            names = list(self._kube)
            stats = [w.stats for w in self._kube.values()]  # type: ignore[attr-defined]
            yield from fam.WATCH.families_of(stats, "resource", names)

    def _ttft_views(self) -> Iterator[Metric]:
        """What each `predicted-ttft-scorer` holds per endpoint (replicas compare them)."""
        # Named as the shared channel names them, so replicas' views line up by label.
        scorers = SharedPlacements.scorers(self._p.router.scheduler.plugins)
        if not scorers:
            return
        queue = gauge(
            "extproc_predicted_prefill_queue_seconds",
            "Prefill seconds predicted-ttft-scorer counts queued on the endpoint now (its "
            "placements', and the peers' when placements are shared).",
            ["scorer", "endpoint"],
        )
        written = gauge(
            "extproc_predicted_written_tokens",
            "Tokens predicted-ttft-scorer counts written into the endpoint's cache since it "
            "started (eviction model).",
            ["scorer", "endpoint"],
        )
        fallbacks = counter(
            "extproc_predicted_ttft_floor_fallbacks",
            "Predictions whose in-flight floor counted every in-flight request until it ends "
            "(decoding included): the endpoint's engine gave no fresh first-token and "
            "finished counts (vllm:time_to_first_token_seconds, vllm:request_success_total).",
            ["scorer"],
        )
        drained = counter(
            "extproc_predicted_ttft_peer_tokens_drained",
            "Other replicas' in-flight tokens predicted-ttft-scorer left out of its in-flight "
            "floor as already prefilled (peerInflight: drained), summed over predictions.",
            ["scorer"],
        )
        kv_fit = counter(
            "extproc_predicted_ttft_kv_fit",
            "predicted-ttft-scorer's kvFit: wait, by outcome: waited (predictions where the "
            "request did not fit in the endpoint's free KV cache and waited for a running "
            "request to end), untimed (of those, timed without a decode-time measurement: "
            "the running prefills' ends alone), changed (scored requests whose fastest "
            "endpoint the wait changed), peers (of the waits, those the other replicas' "
            "placements since the scrape alone caused: kvFitPeers: arrivals), idle_prefix "
            "(waits only because the request's cached prefix, shared by no running "
            "placement, was counted: kvFitPrefix: running), prefix_unknown (predictions "
            "that took the cached prefix as held because other replicas have requests in "
            "flight there).",
            ["scorer", "outcome"],
        )
        spill = counter(
            "extproc_predicted_ttft_spill_cost",
            "predicted-ttft-scorer's spillCost: fleetBusy, by outcome: charged (decisions "
            "where some candidate was charged the prefill it adds beyond the prompt's best "
            "holder, weighted by the share of candidates busy), changed (of those, the ones "
            "where the charge moved the scorer's fastest endpoint).",
            ["scorer", "outcome"],
        )
        mean = gauge(
            "extproc_predicted_mean_prefill_tokens",
            "The mean placed prefill (estimated uncached tokens) predicted-ttft-scorer counts "
            "each scraped waiting request as (0 before the first placement).",
            ["scorer"],
        )
        pooled = counter(
            "extproc_predicted_ttft_mean_pooled",
            "Other replicas' placements predicted-ttft-scorer averaged into its mean placed "
            "prefill (meanPlacements: fleet).",
            ["scorer"],
        )
        written_pooled = counter(
            "extproc_predicted_ttft_written_pooled_tokens",
            "Tokens other replicas placed that predicted-ttft-scorer counted as written into "
            "the endpoints' caches (writtenPlacements: fleet).",
            ["scorer"],
        )
        for name, scorer in scorers.items():
            mean.add_metric([name], scorer.mean_prefill or 0.0)
            pooled.add_metric([name], scorer.mean_pooled)
            written_pooled.add_metric([name], scorer.written_pooled)
            kv_fit.add_metric([name, "waited"], scorer.kv_fit_waits)
            kv_fit.add_metric([name, "untimed"], scorer.kv_fit_untimed)
            kv_fit.add_metric([name, "changed"], scorer.kv_fit_changed)
            kv_fit.add_metric([name, "peers"], scorer.kv_fit_peers)
            kv_fit.add_metric([name, "idle_prefix"], scorer.kv_fit_idle_prefix)
            kv_fit.add_metric([name, "prefix_unknown"], scorer.kv_fit_prefix_unknown)
            spill.add_metric([name, "charged"], scorer.spill_charged)
            spill.add_metric([name, "changed"], scorer.spill_changed)
            for address, (q, w) in scorer.view().items():
                queue.add_metric([name, address], q)
                written.add_metric([name, address], w)
            fallbacks.add_metric([name], scorer.floor_fallbacks)
            drained.add_metric([name], scorer.peer_tokens_drained)
        yield queue
        yield written
        yield fallbacks
        yield drained
        yield kv_fit
        yield spill
        yield mean
        yield pooled
        yield written_pooled

    def _kv_events(self) -> Iterator[Metric]:
        assert self._p.subscriber is not None
        k = self._p.subscriber.stats
        yield from fam.KV_EVENTS.families(k)
        # How long since anything arrived at all (a silent publisher shows here).
        now = time.monotonic()
        if k.messages != self._kv_seen[0]:
            self._kv_seen = (k.messages, now)
        yield one(
            "extproc_kv_events_last_message_age_seconds",
            "Seconds since a KV-event message last arrived, or since start when none has "
            "(at scrape resolution).",
            now - self._kv_seen[1],
        )
        if self._p.silence is not None:
            yield from self._kv_silence(self._p.silence)

    def _kv_silence(self, watch: SilenceWatch) -> Iterator[Metric]:
        """Per endpoint: KV-event silence while the picker places requests there."""
        silent = gauge(
            "extproc_kv_events_silent",
            "1 while the endpoint's KV-event publisher has sent nothing for more placements "
            "than its usual rate makes likely (its cache is not being learned; logged).",
            ["endpoint"],
        )
        periods = counter(
            "extproc_kv_events_silent_periods",
            "Times the endpoint's KV-event publisher went silent while requests were "
            "placed on it (since the endpoint joined the pool).",
            ["endpoint"],
        )
        unanswered = gauge(
            "extproc_kv_events_unanswered_placements",
            "Placements on the endpoint since its last KV-event message.",
            ["endpoint"],
        )
        for e in self._p.pool.snapshot():
            v = watch.view(e.address)
            silent.add_metric([e.address], 1.0 if v.silent else 0.0)
            periods.add_metric([e.address], v.periods)
            unanswered.add_metric([e.address], v.unanswered)
        yield silent
        yield periods
        yield unanswered

    def _request_ends(self) -> Iterator[Metric]:
        p = self._p
        yield from fam.REQUEST_ENDS.families(p.ends.stats)
        if p.shared_ends is not None:
            yield from _shared(
                fam.SHARED_REQUEST_ENDS,
                p.shared_ends,
                "extproc_shared_request_ends_degraded",
                "1 while request ends are not shared (Redis failing): holds of requests whose "
                "access-log entry reached another replica expire at max_hold_s.",
            )
        yield one(
            "extproc_access_log_streams", "Access-log streams open now.", p.access_log.streams
        )
        lost = counter(
            "extproc_access_log_streams_lost",
            "Access-log streams the proxy closed (not the picker's drain); the last one's loss "
            "is logged, and the next stream's opening with how long there was none.",
        )
        lost.add_metric([], p.access_log.lost)
        yield lost
        tps = gauge(
            "extproc_prefill_tokens_per_second",
            "Prefill speed learned per endpoint (uncached tokens per prefill second from the "
            "engine's histograms, else per second to first byte from the access log).",
            ["endpoint"],
        )
        for address, value in p.speeds.snapshot().items():
            tps.add_metric([address], value)
        yield tps
        sources = gauge(
            "extproc_prefill_speed_endpoints",
            "Endpoints with a learned prefill speed, by source: engine (its prefill "
            "histograms) or access_log (time to first byte, queueing included: the engine "
            "exports no prefill histograms).",
            ["source"],
        )
        for source, n in p.speeds.sources().items():
            sources.add_metric([source], n)
        yield sources
        overlap = gauge(
            "extproc_prefill_overlap",
            "Per endpoint with engine prefill histograms: its requests' prefill seconds summed "
            "over the seconds it was busy prefilling (how many prefills shared each busy "
            "second; the per-request speed is the busy one over this).",
            ["endpoint"],
        )
        for address, value in p.speeds.overlaps().items():
            overlap.add_metric([address], value)
        yield overlap
        estimator = gauge(
            "extproc_prefill_speed_estimator",
            "1, labelled with how engine histograms become a prefill speed (busy: per second "
            "the engine was busy prefilling; request: per second of each request's prefill).",
            ["estimator"],
        )
        estimator.add_metric([p.speeds.estimator], 1.0)
        yield estimator

    def _endpoints(self) -> Iterator[Metric]:
        """Per endpoint: scraped-state age and staleness, scrape failures."""
        p = self._p
        if p.scraper is None:
            return
        age = gauge(
            "extproc_endpoint_state_age_seconds",
            "Age of the endpoint's last successful metrics scrape (absent: never scraped).",
            ["endpoint"],
        )
        stale = gauge(
            "extproc_endpoint_stale",
            "1 when the endpoint's scraped figures are older than stale_after_s or missing.",
            ["endpoint"],
        )
        failures = counter(
            "extproc_endpoint_scrape_failures",
            "Failed metrics scrapes of the endpoint since it joined the pool.",
            ["endpoint"],
        )
        corrections = gauge(
            "extproc_endpoint_prefill_abort_correction",
            "Cut (aborted) requests the count of the endpoint's requests before their first "
            "token corrects for, since its engine started (a lower bound): "
            "counted_before_first, counted as finished without a first token; "
            "uncounted_after_first, never counted as finished after a first token.",
            ["endpoint", "kind"],
        )
        for e in p.pool.snapshot():
            a = p.states.age_s(e.address)
            if a is not None:
                age.add_metric([e.address], a)
            stale.add_metric([e.address], 1.0 if p.states.is_stale(e.address) else 0.0)
            failures.add_metric([e.address], p.scraper.failures(e.address))
            c = p.states.abort_corrections(e.address)
            if c is not None:
                corrections.add_metric([e.address, "counted_before_first"], c.counted_before_first)
                corrections.add_metric(
                    [e.address, "uncounted_after_first"], c.uncounted_after_first
                )
        yield age
        yield stale
        yield failures
        yield corrections
        yield from fam.SCRAPE.families(p.scraper.stats)
