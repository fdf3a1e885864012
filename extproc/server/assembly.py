"""The parts of a picker process, built from Settings: index, endpoint state and scrapers,
in-flight counts, request ends, calibration, the router with its scheduler, flow control,
the KV-event subscriber and the latency learners. Building starts nothing: the lifecycle
(server/lifecycle.py) runs the loops and binds the ports, the exporter (server/exporter.py)
reads their stats. Cross-field checks of the settings live in the config loader; the few
here are the ones only building can tell."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence

from extproc.calibration import Calibration
from extproc.config import (
    Settings,
    build_configured_flow_control,
    build_configured_scheduler,
    flow_control_configured,
)
from extproc.core import Endpoint, InferenceRequest
from extproc.endpoints import EndpointPool, InFlight
from extproc.endpoints.dcgm import DCGMScraper
from extproc.endpoints.decode_time import DecodeTimes
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.endpoints.request_end import RequestEnds
from extproc.endpoints.scrape import MetricsScraper
from extproc.endpoints.shared_inflight import SharedInFlight
from extproc.endpoints.state import EndpointStates
from extproc.errors import ConfigError
from extproc.hashing.tokenizer import PreciseKeys
from extproc.index.base import IndexOptions, KVIndex
from extproc.index.placed import PlacedBlocks
from extproc.index.silence import SilenceWatch
from extproc.router import Router
from extproc.scheduling.plugins.ttft import PredictedTTFTScorer
from extproc.scheduling.timing import instrument
from extproc.server import latency as latency_wiring
from extproc.server.access_log import AccessLogHandler
from extproc.server.health import Health
from extproc.server.llmd_metrics import BuildInfo, PoolView
from extproc.server.metrics import PickerMetrics
from extproc.signals import Signals

log = logging.getLogger("extproc.server")


def build_index(settings: Settings) -> KVIndex | None:
    cfg = settings.index
    options = IndexOptions(
        approx_ttl_s=cfg.approx_ttl_s,
        capacity_blocks=cfg.capacity_blocks,
        tier_weights=dict(cfg.tier_weights),
    )
    if cfg.backend == "memory":
        from extproc.index.memory import MemoryKVIndex

        return MemoryKVIndex(options)
    if not cfg.redis_url:
        raise ConfigError("required with backend: redis", path=("index", "redis_url"))
    from extproc.index.redis import RedisKVIndex

    return RedisKVIndex.from_url(
        cfg.redis_url,
        cluster=cfg.cluster,
        options=options,
        lookup_budget_s=cfg.lookup_budget_s,
        lookup_budget_max_s=cfg.lookup_budget_max_s,
    )


class Parts:
    """Every component of one picker process, wired to each other, not yet running."""

    def __init__(
        self,
        settings: Settings,
        endpoints: Sequence[Endpoint],
        *,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        """`environ` is only read for Kubernetes credentials (in-cluster service account or
        $KUBECONFIG) and build info; the CLI passes the process environment."""
        self.settings = settings
        self._environ = dict(environ or {})
        precise_cfg = settings.parse.precise
        if settings.index.kv_events is not None and precise_cfg is None:
            raise ConfigError(
                "KV events need precise keys: set parse.precise (tokenizer_dir, model)",
                path=("index", "kv_events"),
            )
        self.precise = PreciseKeys.from_settings(precise_cfg) if precise_cfg else None
        self.index = build_index(settings)
        record = settings.index.record_decisions
        if record is None:
            record = settings.index.kv_events is None
        self.pool = EndpointPool(endpoints)
        self.metrics = PickerMetrics()
        state = settings.state
        # Without scraping nothing is fresh anyway: the class's default staleness then.
        self.states = (
            EndpointStates(stale_after_s=state.scrape.stale_after_s)
            if state.scrape
            else EndpointStates()
        )
        self.scraper = (
            MetricsScraper(
                self.pool,
                self.states,
                state.scrape,
                on_invalidate=self._invalidate_endpoint,
                on_scrape=self._scraped,
            )
            if state.scrape
            else None
        )
        self.dcgm = DCGMScraper(self.pool, self.states, state.dcgm) if state.dcgm else None
        self.inflight: InFlight | SharedInFlight = InFlight()
        if settings.index.backend == "redis" and state.shared_inflight is not None:
            assert settings.index.redis_url is not None  # build_index checked it
            self.inflight = SharedInFlight.from_url(
                settings.index.redis_url,
                cluster=settings.index.cluster,
                settings=state.shared_inflight,
            )
        self.inflight_push = self._push_placements()
        self.speeds = PrefillSpeeds(state.prefill_speed)
        self.decode_times = DecodeTimes()
        self.ends = RequestEnds(
            self.inflight.release,
            state.request_end,
            on_end=lambda p, e: self.speeds.observe(p.address, p.tokens, e.ttfb_s),
        )
        self.access_log = AccessLogHandler(self.ends)
        self.shared_ends = None
        if settings.index.backend == "redis" and settings.index.redis_url:
            self.shared_ends = self._share_request_ends(settings.index.redis_url)
        # Approximate keys only: precise keys come from the real tokenizer and block size.
        self.calibration = Calibration(
            settings.parse,
            enabled=settings.parse.calibrate and self.precise is None,
            approximate_keys=self.precise is None,
        )
        # Precise mode: publishers silent while requests are placed on their endpoints.
        ev = settings.index.kv_events
        # Replicas sharing a Redis index may share one bound address too, each publisher
        # feeding whichever replica it reached: they judge silence fleet-wide (alone, one
        # never heard here is not judged).
        shared_bind = ev is not None and ev.bind is not None and settings.index.backend == "redis"
        self.silence = (
            SilenceWatch(judge_unheard=not shared_bind)
            if ev is not None and self.index is not None and self.precise
            else None
        )
        self.shared_silence = self._share_silence() if shared_bind else None
        self.router = Router(
            pool=self.pool,
            scheduler=instrument(build_configured_scheduler(settings), self.metrics.llmd),
            parser=self.calibration,
            inflight=self.inflight,
            index=self.index,
            precise=self.precise,
            states=self.states if self.scraper or self.dcgm else None,
            is_failing=self.scraper.is_failing if self.scraper and state.exclude_failing else None,
            record_decisions=record,
            on_lookup=self.metrics.lookup_seconds.observe,
            on_placed=self._on_placed(),
            ends=self.ends,
            speeds=self.speeds,
            lookup_budget_follows_prefill=settings.index.lookup_budget == "prefill",
            capacity_first_tokens=settings.index.capacity_first_tokens,
            placed=self._placed_blocks(record),
        )
        self.calibration.on_units.append(self.router.estimate_units_changed)
        if self.calibration.enabled:
            # Pairing at the request's end wherever the end is known (extproc/calibration.py).
            ends = self.ends
            self.calibration.ends_known = lambda: ends.holding
            self.router.on_request_end = self.calibration.ended
        capacity = self.router.capacity_stats
        if capacity is not None:
            # Predicted TTFT's `speedUnits: estimates` converts the engines' speeds into the
            # estimates' unit with the KV-capacity model's measured ratio.
            for plugin in self.router.scheduler.plugins:
                if isinstance(plugin, PredictedTTFTScorer):
                    plugin.token_ratio = lambda stats=capacity: stats.ratio
        for plugin in self.router.scheduler.plugins:
            if isinstance(plugin, PredictedTTFTScorer):
                # `kvFit: wait` times a wait for KV blocks by the engines' decode times.
                plugin.decode_s = self.decode_times.get
        if isinstance(self.inflight, SharedInFlight):
            # Predicted TTFT's floor may count the peers' in-flight tokens drained by time
            # (its `peerInflight`); the exchange dates them.
            for plugin in self.router.scheduler.plugins:
                if isinstance(plugin, PredictedTTFTScorer):
                    plugin.peer_arrivals = self.inflight.arrivals
                    # `meanPlacements: fleet` averages the peers' placements too.
                    plugin.peer_placements = self.inflight.peer_placements
        self.shared_sessions = self._share_sessions()
        self.shared_growth = self._share_growth()
        # What `state.shared_observations: auto` decided, logged once the ports are bound.
        self.observation_sharing: str | None = None
        self.shared_observations = self._share_observations()
        self.shared_placements = self._share_placements()
        # What `state.shared_scrapes: auto` decided, logged once the ports are bound.
        self.scrape_sharing: str | None = None
        self.shared_scrapes = self._share_scrapes()
        # What `state.shared_calibration: auto` decided, logged once the ports are bound
        # (a picker that cannot start says one line).
        self.calibration_pooling: str | None = None
        self.shared_calibration = self._share_calibration()
        self.admission = self._build_admission()
        self.subscriber = self._build_subscriber()
        self.latency = latency_wiring.learners(
            self.router.scheduler.plugins, self.pool, self.states if self.scraper else None
        )
        self.signals = Signals(
            scraped_metrics=self.scraper is not None,
            kv_events=self.subscriber is not None,
            approximate_index=self.index is not None and record,
        )
        self.health = Health()
        # Discovery loops, each with a `synced` event (filled by the lifecycle).
        self.watches: list = []
        self.metrics.llmd.attach_pool(self._pool_view())
        self.metrics.llmd.build = BuildInfo.installed(self._environ)

    def _pool_view(self) -> PoolView:
        """llm-d's pool gauges: named after the InferencePool when discovery watches one."""
        d, scraped = self.settings.discovery, self.scraper is not None
        return PoolView(
            name=d.inference_pool or "extproc",
            namespace=d.namespace or "",
            endpoints=self.pool.snapshot,
            states=self.states.state if scraped else None,
        )

    def _process_id(self) -> str:
        """This replica's name on the shared channels: the shared in-flight record's, when
        there is one, so every channel names a replica alike."""
        from extproc.endpoints.shared_inflight import default_process_id

        return getattr(self.inflight, "process_id", None) or default_process_id()

    def _push_placements(self):
        """Replicas sharing in-flight counts push each placement to the others at decision
        time (Redis pub/sub; `state.shared_inflight.push`), not only in the exchange."""
        inflight, shared = self.inflight, self.settings.state.shared_inflight
        if not isinstance(inflight, SharedInFlight) or shared is None or not shared.push:
            return None
        if self.settings.index.cluster:
            log.warning(
                "placements are not pushed on Redis Cluster: the replicas see each other's "
                "placements through the shared in-flight exchange alone"
            )
            return None
        from extproc.endpoints.inflight_push import InFlightPush

        url = self.settings.index.redis_url
        assert url is not None  # a SharedInFlight was built on it
        return InFlightPush.from_url(
            url, inflight, known=lambda address: self.pool.get(address) is not None
        )

    def _share_request_ends(self, url: str):
        """Replicas behind one gateway get each other's access-log entries (Redis pub/sub)."""
        if self.settings.index.cluster:
            log.warning(
                "request ends are not shared on Redis Cluster: holds of requests "
                "logged to another replica end by max_hold_s"
            )
            return None
        from extproc.endpoints.shared_request_end import SharedRequestEnds

        pid = self._process_id()
        return SharedRequestEnds.from_url(url, self.ends, process_id=pid)

    def _shared_redis(self, option: str, on_cluster: str) -> str | None:
        """The Redis URL an opt-in `state.<option>` shares through, or None: off, no Redis
        index, or Redis Cluster (these pub/sub channels run on one node's client). Asked
        for but impossible is a warning, so a fleet that expected sharing sees why not."""
        idx = self.settings.index
        if not getattr(self.settings.state, option):
            return None
        if idx.backend != "redis" or not idx.redis_url:
            log.warning("state.%s needs a Redis index: nothing is shared", option)
            return None
        if idx.cluster:
            log.warning(on_cluster)
            return None
        return idx.redis_url

    def _share_observations(self):
        """Replicas sharing a Redis index learn prefill speeds and new-prefix spreading
        from every replica's placements (Redis pub/sub). `auto`: on where it can be and the
        scheduler has something to share, said in a log line either way."""
        from extproc.server.shared_observations import SharedObservations

        lru = SharedObservations.lru_scorers(self.router.scheduler.plugins)
        if self.settings.state.shared_observations == "auto":
            url, why = self._auto_index_url()
            if why is None and not lru and not self._speed_readers():
                why = (
                    "nothing to share: no no-hit-lru-scorer, and nothing reads prefill speeds "
                    "(no predicted-ttft-scorer, index.lookup_budget fixed, no flow control)"
                )
            self.observation_sharing = _auto_line(
                "shared_observations",
                why,
                "replicas share new-prefix picks and prefill-speed samples",
            )
            if why or url is None:
                return None
        else:
            url = self._shared_redis(
                "shared_observations",
                "prefill speeds and new-prefix picks are not shared on Redis Cluster: "
                "each replica learns from its own placements",
            )
            if url is None:
                return None
        return SharedObservations.from_url(
            url,
            self.speeds,
            lru,
            process_id=self._process_id(),
            known=lambda address: self.pool.get(address) is not None,
        )

    def _speed_readers(self) -> bool:
        """Whether anything decides by the learned prefill speeds (what shared observations
        share besides new-prefix picks): predicted TTFT, a lookup budget sized by prefill,
        flow control's reserve."""
        return (
            any(isinstance(p, PredictedTTFTScorer) for p in self.router.scheduler.plugins)
            or self.settings.index.lookup_budget == "prefill"
            or flow_control_configured(self.settings)
        )

    def _share_scrapes(self):
        """Replicas sharing a Redis index divide the servers' scrapes among themselves
        (Redis pub/sub; who is alive: the shared in-flight exchange). `auto` (the default):
        on where it can be, said in a log line either way."""
        inflight = self.inflight
        if self.settings.state.shared_scrapes == "auto":
            url, why = self._auto_index_url()
            if self.scraper is None:
                why = "no scraping"
            elif why is None and not isinstance(inflight, SharedInFlight):
                why = "no shared in-flight counts"
            self.scrape_sharing = _auto_line(
                "shared_scrapes",
                why,
                "replicas divide the servers' scrapes; alone, this one scrapes them all",
            )
            if why:
                return None
        else:
            url = self._shared_redis(
                "shared_scrapes",
                "scrapes are not shared on Redis Cluster: every replica scrapes every server",
            )
            if url is None or self.scraper is None:
                return None
            if not isinstance(inflight, SharedInFlight):
                log.warning(
                    "state.shared_scrapes needs state.shared_inflight (who is alive): every "
                    "replica scrapes every server"
                )
                return None
        assert url is not None and self.scraper is not None
        assert isinstance(inflight, SharedInFlight)
        from extproc.server.shared_scrapes import SharedScrapes

        scrape = self.settings.state.scrape
        assert scrape is not None  # a scraper exists
        return SharedScrapes.from_url(
            url,
            self.scraper,
            inflight.peers,
            process_id=self._process_id(),
            takeover_s=scrape.stale_after_s,
        )

    def _share_silence(self):
        """Replicas sharing a Redis index behind one bound KV-event address judge their
        publishers' silence fleet-wide: each tells the others which endpoints it heard (Redis
        pub/sub), the in-flight exchange brings the others' placements."""
        watch, inflight, idx = self.silence, self.inflight, self.settings.index
        if watch is None:
            return None
        if not isinstance(inflight, SharedInFlight):
            log.warning(
                "kv events: silence is judged per replica (state.shared_inflight is off: "
                "the peers' placements are unknown); an endpoint never heard here is not judged"
            )
            return None
        if idx.cluster or not idx.redis_url:
            log.warning(
                "kv events: silence is judged per replica on Redis Cluster (pub/sub is per "
                "node); an endpoint never heard here is not judged"
            )
            return None
        from extproc.server.shared_silence import SharedSilence

        shared = SharedSilence.from_url(
            idx.redis_url,
            watch,
            process_id=self._process_id(),
            peers_ok=lambda: not inflight.is_degraded,
            peers=inflight.peers,
            known=lambda address: self.pool.get(address) is not None,
        )
        inflight.on_peer_placed = shared.peer_placed
        return shared

    def _share_placements(self):
        """Replicas sharing a Redis index fold each other's placements into predicted TTFT's
        prefill queues and written tokens (Redis pub/sub)."""
        url = self._shared_redis(
            "shared_placements",
            "predicted-TTFT placements are not shared on Redis Cluster: each replica's "
            "prefill queues and written tokens count its own placements",
        )
        if url is None:
            return None
        from extproc.server.shared_placements import SharedPlacements

        scorers = SharedPlacements.scorers(self.router.scheduler.plugins)
        if not scorers:
            log.warning(
                "state.shared_placements: the scheduling profile has no predicted-ttft-scorer, "
                "so there are no placements to share"
            )
            return None
        pid = self._process_id()
        return SharedPlacements.from_url(
            url,
            scorers,
            process_id=pid,
            known=lambda address: self.pool.get(address) is not None,
        )

    def _share_calibration(self):
        """Replicas sharing a Redis index pool approximate mode's calibration (Redis pub/sub
        and one key). `auto` (the default): on where it can be, said in a log line either
        way."""
        if self.settings.state.shared_calibration == "auto":
            return self._share_calibration_auto()
        url = self._shared_redis(
            "shared_calibration",
            "calibration is not shared on Redis Cluster: each replica calibrates from "
            "its own placements",
        )
        if url is None:
            return None
        if not self.calibration.enabled:
            log.warning(
                "state.shared_calibration: calibration is off (parse.calibrate false or "
                "precise keys): nothing is shared"
            )
            return None
        return self._pool_calibration(url)

    def _share_calibration_auto(self):
        url, why = self._auto_index_url()
        if not self.calibration.enabled:
            why = "calibration is off (parse.calibrate false or precise keys)"
        self.calibration_pooling = _auto_line(
            "shared_calibration", why, "replicas pool approximate mode's calibration"
        )
        if why or url is None:
            return None
        return self._pool_calibration(url)

    def _auto_index_url(self) -> tuple[str | None, str | None]:
        """For a `state.<option>: auto`: the URL of the non-Cluster Redis index it shares
        through, or None and why not."""
        idx = self.settings.index
        if idx.backend == "redis" and idx.redis_url and not idx.cluster:
            return idx.redis_url, None
        return None, "Redis Cluster" if idx.backend == "redis" and idx.cluster else "no Redis index"

    def _pool_calibration(self, url: str):
        from extproc.server.shared_calibration import SharedCalibration

        self.calibration.on_peer_placed.append(self.router.peer_placed)
        return SharedCalibration.from_url(
            url,
            self.calibration,
            process_id=self._process_id(),
            known=lambda address: self.pool.get(address) is not None,
        )

    def _share_sessions(self):
        """Replicas sharing a Redis index share the live-session record too."""
        idx = self.settings.index
        if idx.backend != "redis" or not idx.redis_url:
            return None
        from extproc.server.shared_sessions import SharedSessions

        records = SharedSessions.records(self.router.scheduler.plugins)
        if not records:
            return None
        pid = self._process_id()
        window = max(r.window_s for r in records.values())
        return SharedSessions.from_url(
            idx.redis_url, records, cluster=idx.cluster, process_id=pid, window_s=window
        )

    def _share_growth(self):
        """Replicas sharing a Redis index share what `bounded-sessions-filter`s with
        `shareGrowth` learn of session growth (Redis pub/sub). Without a Redis index there
        are no peers to share with (the session record is not shared either)."""
        idx = self.settings.index
        if idx.backend != "redis" or not idx.redis_url:
            return None
        from extproc.server.shared_growth import SharedGrowth

        records = SharedGrowth.records(self.router.scheduler.plugins)
        if not records:
            return None
        if idx.cluster:
            # On by default, so said as the other defaults that cannot be on there are.
            log.info(
                "bounded-sessions-filter shareGrowth: off on Redis Cluster (pub/sub is per "
                "node): each replica learns session growth from the later turns it places"
            )
            return None
        return SharedGrowth.from_url(idx.redis_url, records, process_id=self._process_id())

    def _build_admission(self):
        """Flow control (docs/flow-control.md), when configured: the router's admission hook."""
        flow = build_configured_flow_control(self.settings)
        if flow is None:
            return None
        from extproc.flowcontrol.admission import Admission

        router = self.router

        def endpoint_states(endpoints):
            inflight, states = router.inflight, router.states
            out = []
            for e in endpoints:
                a = e.address
                out.append((a, states.state(a, inflight.requests(a), inflight.tokens(a))))
            return out

        def pool_endpoints():
            # Where the router may place a request now (not a server it routes around:
            # admitted for that one, a request landed on another, full one).
            return endpoint_states(router.routable())

        def pool_states():
            return [s for _, s in endpoint_states(self.pool.snapshot())]

        idx = self.settings.index
        url = idx.redis_url if flow.settings.shared and idx.backend == "redis" else None
        try:
            admission = Admission(
                flow,
                pool_states,
                registry=self.metrics.registry,
                endpoints=pool_endpoints,
                # The reserve for higher bands is sized by a prefill's time alone.
                prefill_speed=self.speeds.fastest,
            )
        except ValueError as exc:
            raise ConfigError(str(exc), path=("flow_control", "objectives_file")) from None
        if url:
            from extproc.flowcontrol.shared import SharedFlowState

            admission.shared = SharedFlowState.from_url(
                url,
                admission.controller,
                cluster=idx.cluster,
                interval_s=flow.settings.share_interval_s,
            )
        router.admission = admission
        # After the router's listener (which rescales the in-flight prompts): the detector's
        # ceiling and the engine-blocks counts follow a bytes-per-token change too.
        self.calibration.on_units.append(admission.units_changed)
        # `output_token_scale: auto` follows calibration (`_scraped`); without it, said once.
        if self.precise is not None:
            admission.output_scale.exact()
            admission.engine_blocks.exact(self.precise.block_size)
        elif not self.calibration.enabled:
            admission.output_scale.unmeasurable("calibration is off (parse.calibrate false)")
        elif self.scraper is None:
            admission.output_scale.unmeasurable("endpoints are not scraped (state.scrape)")
        return admission

    def _on_placed(self) -> Callable[[str, InferenceRequest], None] | None:
        """What each placement tells besides the router's own figures: calibration
        (approximate keys), the KV-event silence watch (precise mode)."""
        calibrate = self.calibration.placed if self.calibration.enabled else None
        silence = self.silence
        if silence is None:
            return calibrate
        if calibrate is None:
            return lambda address, _request: silence.placed(address)

        def both(address: str, request: InferenceRequest) -> None:
            calibrate(address, request)
            silence.placed(address)

        return both

    def _placed_blocks(self, record: bool) -> PlacedBlocks | None:
        """Precise mode: the picker's placements correct the events' picture (config
        `index.kv_events.credit_placements`)."""
        ev = self.settings.index.kv_events
        if ev is None or record or not ev.credit_placements or self.index is None:
            return None
        return PlacedBlocks()

    def _build_subscriber(self):
        ev = self.settings.index.kv_events
        if ev is None or self.index is None or self.precise is None:
            return None
        from extproc.index.curve import CurveKeys
        from extproc.index.subscriber import KVEventSubscriber

        sub = KVEventSubscriber(
            self.index,
            model=self.precise.model,
            bind=ev.bind,
            block_size=self.precise.block_size,
            replay_port=ev.replay_port if ev.bind is not None else None,
            is_member=lambda address: self.pool.get(address) is not None,
            curve=CurveKeys.from_settings(ev),
            on_message=self.silence.heard if self.silence is not None else None,
            on_cleared=self.router.cache_cleared,
        )
        if ev.bind is None:
            for e in self.pool.snapshot():
                sub.watch(self.event_source(e))
        return sub

    def _scraped(self, address: str, scraped, age_s: float = 0.0) -> None:
        lat = scraped.latency
        finished = (lat.prompt_sum, lat.prompt_count) if lat is not None else None
        self.calibration.observe(address, scraped.kv_block_size, scraped.prompt_tokens, finished)
        if self.admission is not None:
            self.admission.output_scale.measured(self.calibration.stats.ratios)
            self.admission.engine_blocks.measured(
                self.calibration.stats.ratios, scraped.kv_block_size
            )
        # The engine's own prefill timing, queueing excluded (endpoints/prefill_speed.py).
        self.speeds.scraped(address, scraped.latency, age_s=age_s)
        self.decode_times.scraped(address, scraped.latency)

    async def _invalidate_endpoint(self, address: str, reason: str) -> None:
        """The scraper saw `address` restart or stop answering: its cache is not what the
        index says (a restarted vLLM starts empty and publishes nothing until used)."""
        if self.subscriber is not None:
            await self.subscriber.invalidate(address)
        elif self.index is not None:
            await self.index.remove_endpoint(address)
        await self.router.forget_endpoint(address)

    def event_source(self, e: Endpoint):
        """Where endpoint `e` publishes KV events (connect mode)."""
        from extproc.index.subscriber import EventSource

        ev = self.settings.index.kv_events
        assert ev is not None
        host = e.address.rpartition(":")[0]
        replay = f"tcp://{host}:{ev.replay_port}" if ev.replay_port else None
        return EventSource(e.address, f"tcp://{host}:{ev.port}", replay_url=replay)


def _auto_line(option: str, why: str | None, on: str) -> str:
    """The line a `state.<option>: auto` logs once the ports are bound: off and why, or on
    and what that does."""
    return (
        f"state.{option} auto: off ({why})"
        if why
        else f"state.{option} auto: on (Redis index): {on}"
    )
