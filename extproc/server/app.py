"""The process: builds every component from Settings, serves ext_proc, health and the admin
port, runs the background loops, and drains on stop.

`async with App(settings, endpoints) as app: await app.serve()`; `app.stop()` (what SIGTERM
calls) marks health NOT_SERVING, lets open streams finish within `grace_s`, then tears down
in reverse order: servers -> loops -> queued index writes -> clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence

import grpc
from aiohttp import web

from extproc import protocol
from extproc.calibration import Calibration
from extproc.config import Settings, build_configured_flow_control, build_configured_scheduler
from extproc.core import Endpoint
from extproc.endpoints import EndpointPool, InFlight
from extproc.endpoints.dcgm import DCGMScraper
from extproc.endpoints.prefill_speed import PrefillSpeeds
from extproc.endpoints.request_end import RequestEnds
from extproc.endpoints.scrape import MetricsScraper
from extproc.endpoints.shared_inflight import SharedInFlight
from extproc.endpoints.state import EndpointStates
from extproc.errors import ConfigError
from extproc.hashing.tokenizer import PreciseKeys
from extproc.index.base import IndexOptions, KVIndex
from extproc.router import Router
from extproc.scheduling.timing import instrument
from extproc.server import latency as latency_wiring
from extproc.server import wire
from extproc.server.access_log import AccessLogHandler
from extproc.server.admin import make_admin_app
from extproc.server.guard import lenient_deserializer
from extproc.server.health import Health
from extproc.server.llmd_metrics import BuildInfo, PoolView
from extproc.server.metrics import PickerMetrics, counter, gauge
from extproc.server.ports import PortInUse, bind_grpc, bind_worker_port, check_ports
from extproc.server.stream import StreamHandler
from extproc.signals import Signals

log = logging.getLogger("extproc.server")

# Keepalive so a proxy that vanished without closing its connection frees its streams.
_SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
)


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
        cfg.redis_url, cluster=cfg.cluster, options=options, lookup_budget_s=cfg.lookup_budget_s
    )


class App:
    def __init__(
        self,
        settings: Settings,
        endpoints: Sequence[Endpoint],
        *,
        environ: Mapping[str, str] | None = None,
        shared_ports: bool = False,
    ) -> None:
        """`environ` is only read for Kubernetes credentials (in-cluster service account or
        $KUBECONFIG); the CLI passes the process environment. `shared_ports`: a `--workers`
        worker, whose ext_proc and health ports are shared with its siblings (SO_REUSEPORT);
        otherwise a second process on the same port is a conflict."""
        self._shared_ports = shared_ports
        self._bound = False
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
        self.states = EndpointStates(
            stale_after_s=state.scrape.stale_after_s if state.scrape else 0.2
        )
        self.scraper = (
            MetricsScraper(
                self.pool,
                self.states,
                state.scrape,
                on_invalidate=self._invalidate_endpoint,
                on_scrape=self._calibrate,
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
        self.speeds = PrefillSpeeds()
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
            settings.parse, enabled=settings.parse.calibrate and self.precise is None
        )
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
            on_placed=self.calibration.placed if self.calibration.enabled else None,
            ends=self.ends,
            speeds=self.speeds,
        )
        self.admission = self._build_admission()
        self.subscriber = self._build_subscriber()
        self.latency = latency_wiring.learners(
            self.router.scheduler.plugins, self.pool, self.states if self.scraper else None
        )
        self.metrics.add_collector(
            functools.partial(latency_wiring.collect, self.latency, self.router.scheduler.plugins)
        )
        self.signals = Signals(
            scraped_metrics=self.scraper is not None,
            kv_events=self.subscriber is not None,
            approximate_index=self.index is not None and record,
        )
        self.health = Health()
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._exits = contextlib.AsyncExitStack()
        self._watches: list = []  # discovery loops, each with a `synced` event
        self._endpoints_changed = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopping = False
        # Set when certificate files are served (reload counters).
        self.tls_reloader: object | None = None
        self.port = 0
        self.worker_port = 0  # this process's own ext_proc port (--worker-ports)
        self.health_port = 0
        self.admin_port = 0
        # Time of the last KV-event message seen at a scrape (the lag gauge's reference).
        self._kv_seen = (0, time.monotonic())
        self.metrics.add_collector(self._collect)
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

    def _share_request_ends(self, url: str):
        """Replicas behind one gateway get each other's access-log entries (Redis pub/sub)."""
        if self.settings.index.cluster:
            log.warning(
                "request ends are not shared on Redis Cluster: holds of requests "
                "logged to another replica end by max_hold_s"
            )
            return None
        from extproc.endpoints.shared_inflight import default_process_id
        from extproc.endpoints.shared_request_end import SharedRequestEnds

        pid = getattr(self.inflight, "process_id", None) or default_process_id()
        return SharedRequestEnds.from_url(url, self.ends, process_id=pid)

    def _build_admission(self):
        """Flow control (docs/flow-control.md), when configured: the router's admission hook."""
        flow = build_configured_flow_control(self.settings)
        if flow is None:
            return None
        from extproc.flowcontrol.admission import Admission

        router = self.router

        def pool_states():
            inflight, states = router.inflight, router.states
            return [
                states.state(e.address, inflight.requests(e.address), inflight.tokens(e.address))
                for e in self.pool.snapshot()
            ]

        try:
            admission = Admission(flow, pool_states, registry=self.metrics.registry)
        except ValueError as exc:
            raise ConfigError(str(exc), path=("flow_control", "objectives_file")) from None
        idx = self.settings.index
        if flow.settings.shared and idx.backend == "redis" and idx.redis_url:
            from extproc.flowcontrol.shared import SharedFlowState

            admission.shared = SharedFlowState.from_url(
                idx.redis_url,
                admission.controller,
                cluster=idx.cluster,
                interval_s=flow.settings.share_interval_s,
            )
        router.admission = admission
        self.metrics.add_collector(admission.collect)
        return admission

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
        )
        if ev.bind is None:
            for e in self.pool.snapshot():
                sub.watch(self._event_source(e))
        return sub

    def _calibrate(self, address: str, scraped) -> None:
        self.calibration.observe(address, scraped.kv_block_size, scraped.prompt_tokens)

    async def _invalidate_endpoint(self, address: str, reason: str) -> None:
        """The scraper saw `address` restart or stop answering: its cache is not what the
        index says (a restarted vLLM starts empty and publishes nothing until used)."""
        if self.subscriber is not None:
            await self.subscriber.invalidate(address)
        elif self.index is not None:
            await self.index.remove_endpoint(address)

    def _event_source(self, e: Endpoint):
        from extproc.index.subscriber import EventSource

        ev = self.settings.index.kv_events
        assert ev is not None
        host = e.address.rpartition(":")[0]
        replay = f"tcp://{host}:{ev.replay_port}" if ev.replay_port else None
        return EventSource(e.address, f"tcp://{host}:{ev.port}", replay_url=replay)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery's callback: swap the pool now (the next request sees it); follow-up work
        that needs awaiting runs in the reconcile loop."""
        self.pool.replace(endpoints)
        self._endpoints_changed.set()

    async def _reconcile(self) -> None:
        """Follow pool changes: KV-event subscriptions, index entries of endpoints that left,
        readiness."""
        known = {e.address for e in self.pool.snapshot()}
        while True:
            await self._endpoints_changed.wait()
            self._endpoints_changed.clear()
            known = await self._apply_endpoints(known)

    async def _apply_endpoints(self, before: set[str]) -> set[str]:
        endpoints = self.pool.snapshot()
        after = {e.address for e in endpoints}
        if self.subscriber is not None and self.settings.index.kv_events.bind is None:  # type: ignore[union-attr]
            for e in endpoints:
                if e.address not in before:
                    self.subscriber.watch(self._event_source(e))
            for gone in before - after:
                self.subscriber.unwatch(gone)
        if self.index is not None:
            for gone in before - after:
                await self.index.remove_endpoint(gone)
        await self.health.set_ready(self._ready())
        return after

    def _ready(self) -> bool:
        """Ready once endpoints are known (discovery has synced) and while not draining."""
        synced = all(w.synced.is_set() for w in self._watches)
        return self._bound and synced and len(self.pool) > 0 and not self._stopping

    async def _start_discovery(self) -> None:
        d = self.settings.discovery
        if d.endpoints_file:
            from extproc.endpoints.filewatch import EndpointFileWatch, load_endpoint_file

            self.pool.replace(load_endpoint_file(d.endpoints_file))
            watch = EndpointFileWatch(d.endpoints_file, self.set_endpoints)
            self._watches.append(watch)
            watch.synced.set()  # loaded above
            self.spawn("endpoints-file", watch.run)
        if d.inference_pool:
            from extproc.endpoints.kubernetes import (
                ApiServer,
                InferencePoolWatch,
                in_cluster_namespace,
            )

            namespace = d.namespace or in_cluster_namespace()
            if not namespace:
                raise ConfigError(
                    "needed outside a cluster (--namespace)", path=("discovery", "namespace")
                )
            api = await ApiServer.load(self._environ, kubeconfig=d.kubeconfig)
            k8s = InferencePoolWatch(api, namespace, d.inference_pool, self.set_endpoints)
            self._watches.append(k8s)
            self.spawn("inferencepool-watch", k8s.run)
            if self.admission is not None and self.admission.objectives.path is None:
                from extproc.endpoints.objectives_watch import InferenceObjectiveWatch

                objectives = InferenceObjectiveWatch(
                    api, namespace, d.inference_pool, self.admission.objectives.replace
                )
                self.spawn("inferenceobjective-watch", objectives.run)
            self.spawn("readiness", self._ready_when_synced)

    async def _ready_when_synced(self) -> None:
        for w in self._watches:
            await w.synced.wait()
        self._endpoints_changed.set()

    def spawn(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop until stop; a crash is logged, never silent."""

        async def guarded() -> None:
            try:
                await loop()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("background loop %s crashed", name)

        self._tasks.append(asyncio.create_task(guarded(), name=name))

    async def __aenter__(self) -> App:
        cfg = self.settings.server
        # Before anything connects or binds: a taken port is one clear error, not a
        # traceback after the ext_proc port already took streams. Workers share two ports.
        shared = {} if self._shared_ports else {"ext_proc": cfg.port, "health": cfg.health_port}
        own = {"worker": cfg.worker_port or 0}
        check_ports(cfg.host, {**shared, **own, "admin": cfg.admin_port or 0})
        try:
            return await self._start(cfg)
        except BaseException:
            if not self._bound:
                # Never served: nothing to drain, close at once.
                for server in (self._server, self._health_server):
                    if server is not None:
                        await server.stop(0)
                self._server = self._health_server = None
            await self.stop()
            raise

    async def _start(self, cfg) -> App:
        handler = StreamHandler.from_settings(self.router, cfg, self.metrics)
        # Registered by full method name: our message classes live in our own proto package
        # (see protos/), the service name is Envoy's.
        method = grpc.stream_stream_rpc_method_handler(
            handler.process,
            request_deserializer=lenient_deserializer,
            response_serializer=wire.ProcessingResponse.SerializeToString,
        )
        generic = grpc.method_handlers_generic_handler(
            protocol.EXT_PROC_SERVICE, {"Process": method}
        )
        if self.index is not None:
            # The index owns its writer loop; entering warms Redis up (scripts, slot map) so
            # the first lookups fit their budget, and leaving flushes queued writes.
            await self._exits.enter_async_context(self.index)  # type: ignore[arg-type]
        await self._start_discovery()
        self.spawn("endpoints", self._reconcile)
        if self.scraper is not None:
            self.spawn("metrics-scraper", self.scraper.run)
        if self.dcgm is not None:
            self.spawn("dcgm", self.dcgm.run)
        if isinstance(self.inflight, SharedInFlight):
            self.spawn("shared-inflight", self.inflight.run)
            # Closed after the loops stop: withdraws this process's load from Redis at once.
            self._exits.push_async_callback(self.inflight.aclose)
        if self.subscriber is not None:
            self.spawn("kv-events", self.subscriber.run)
        for i, learner in enumerate(self.latency):
            self.spawn(f"latency-learner-{i}", learner.run)
        if self.admission is not None:
            self.spawn("flow-control", self.admission.run)
            if self.admission.shared is not None:
                self.spawn("flow-control-shared", self.admission.shared.run)
                self._exits.push_async_callback(self.admission.aclose)
        # NOT_SERVING from the first probe: the health servicer answers SERVING for "" by
        # default, which would let a proxy send traffic before endpoints are known.
        await self.health.set_ready(False)
        # SO_REUSEPORT only between workers: otherwise a second picker would share the port
        # silently and take half the streams.
        reuse = (("grpc.so_reuseport", int(self._shared_ports)),)
        self._server = grpc.aio.server(options=_SERVER_OPTIONS + reuse)
        self._server.add_generic_rpc_handlers((generic, self.access_log.rpc_handler()))
        self.spawn("request-end-sweep", self._sweep_request_ends)
        if self.shared_ends is not None:
            self.spawn("shared-request-ends", self.shared_ends.run)
            self._exits.push_async_callback(self.shared_ends.aclose)
        self.health.add_to(self._server)
        address = f"{cfg.host}:{cfg.port}"
        tls = cfg.effective_tls
        if tls is not None:
            from extproc.server.tls import port_credentials

            creds, self.tls_reloader = port_credentials(tls)
            self.port = bind_grpc("ext_proc", address, self._server.add_secure_port, creds)
        else:
            self.port = bind_grpc("ext_proc", address, self._server.add_insecure_port)
        if cfg.worker_port is not None:
            self.worker_port = bind_worker_port(self._server, cfg, creds if tls else None)
        # Plaintext on purpose: kubelet's gRPC probes have no TLS option. It serves only the
        # health service, so it carries no request data.
        self._health_server = grpc.aio.server(options=reuse)
        self.health.add_to(self._health_server)
        health_address = f"{cfg.host}:{cfg.health_port}"
        self.health_port = bind_grpc(
            "health", health_address, self._health_server.add_insecure_port
        )
        # Every port is bound before any starts listening (the admin site binds as it starts).
        if cfg.admin_port is not None:
            admin = make_admin_app(
                self.router,
                self.metrics,
                self.signals,
                max_body_bytes=cfg.admin_explain_max_bytes,
            )
            self._admin = web.AppRunner(admin, access_log=None)
            await self._admin.setup()
            site = web.TCPSite(self._admin, cfg.admin_host, cfg.admin_port)
            try:
                await site.start()
            except OSError as exc:
                raise PortInUse(
                    "admin", cfg.admin_host, cfg.admin_port, exc.strerror or ""
                ) from None
            self.admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        await self._health_server.start()
        await self._server.start()
        self._bound = True
        await self.health.set_ready(self._ready())
        self.signals.announce()
        for what in self.settings.degraded:
            log.warning("degraded: %s", what, extra={"degraded": what})
        log.info(
            "serving",
            extra={
                "port": self.port,
                "health_port": self.health_port,
                "worker_port": self.worker_port or None,
                "admin_port": self.admin_port,
                "endpoints": len(self.pool),
                "tls": tls is not None,
            },
        )
        return self

    async def _sweep_request_ends(self) -> None:
        """Release holds whose access-log entry never came, even while no request arrives."""
        while True:
            await asyncio.sleep(1.0)
            self.ends.sweep()

    async def serve(self) -> None:
        """Run until `stop()` has drained the server."""
        await self._stopped.wait()

    async def stop(self) -> None:
        """Drain: NOT_SERVING first (so the proxy and Kubernetes stop sending), then let open
        streams finish for up to `grace_s`, then close."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        await self.health.set_ready(False)
        if self.settings.server.drain_delay_s and self._server is not None:
            # Still serving while NOT_SERVING propagates: refusing at once would fail the
            # streams Envoy keeps sending until its health check notices.
            await asyncio.sleep(self.settings.server.drain_delay_s)
        if self._server is not None:
            await self._server.stop(self.settings.server.grace_s)
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._admin is not None:
            await self._admin.cleanup()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._exits.aclose()
        self._stopped.set()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _collect(self):
        sig = gauge(
            "extproc_scheduling_signal",
            "1 for each live signal that feeds scheduling in this process, 0 when off.",
            ["signal"],
        )
        for name, on in self.signals.as_dict().items():
            sig.add_metric([name], 1.0 if on else 0.0)
        yield sig
        cal = self.calibration.stats
        yield _gauge(
            "extproc_approx_block_tokens", "Tokens per approximate block key.", cal.block_tokens
        )
        yield _gauge(
            "extproc_approx_bytes_per_token",
            "Characters per token of approximate keys and token estimates.",
            cal.bytes_per_token,
        )
        yield _counter(
            "extproc_approx_recalibrations",
            "Changes of the approximate block size or characters per token, from the engines.",
            cal.changes,
        )
        r = self.router.stats
        yield _counter("extproc_decisions", "Decisions made (requests routed).", r.decisions)
        faults = counter(
            "extproc_plugin_faults",
            "Scores refused from a scorer (wrong count, NaN, out of [0, 1], or raised); "
            "the scorer is left out of that decision.",
            ["plugin"],
        )
        for profile in self.router.scheduler.profiles.values():
            for plugin, n in profile.faults.counts.items():
                faults.add_metric([plugin], n)
        yield faults
        yield _counter(
            "extproc_index_lookups_degraded",
            "Index lookups answered degraded (Redis slow or down): routed on load alone.",
            r.lookups_degraded,
        )
        yield _counter(
            "extproc_prefix_blocks_requested",
            "Block keys of routed requests.",
            r.prefix_blocks_requested,
        )
        yield _counter(
            "extproc_prefix_blocks_matched",
            "Tier-weighted blocks the chosen endpoint held (hit ratio = matched / requested).",
            r.prefix_blocks_matched,
        )
        yield _counter(
            "extproc_served_elsewhere",
            "Requests the proxy reported served by another endpoint than the pick (a retry "
            "walked the fallback list); in-flight and index followed the served one.",
            r.served_elsewhere,
        )
        g = gauge("extproc_inflight_requests", "Requests in flight per endpoint.", ["endpoint"])
        t = gauge("extproc_inflight_tokens", "Estimated in-flight prompt tokens.", ["endpoint"])
        for e in self.pool.snapshot():
            g.add_metric([e.address], self.router.inflight.requests(e.address))
            t.add_metric([e.address], self.router.inflight.tokens(e.address))
        yield g
        yield t
        yield from self._collect_request_ends()
        yield _gauge("extproc_endpoints", "Endpoints in the pool.", len(self.pool))
        if self.dcgm is not None:
            d = self.dcgm.stats
            yield _counter("extproc_dcgm_polls", "DCGM exporter polls made.", d.polls)
            yield _counter(
                "extproc_dcgm_failures",
                "DCGM polls without a GPU utilization (the endpoint's GPUUtilization is "
                "missing until one succeeds).",
                d.failures,
            )
        yield _gauge(
            "extproc_llmd_degraded",
            "Parts of the llm-d config running with less than asked for (see the start-up log).",
            len(self.settings.degraded),
        )
        yield _gauge(
            "extproc_ready",
            "1 while the picker reports SERVING (endpoints known, not draining).",
            1.0 if self._ready() else 0.0,
        )
        if r.prefix_blocks_requested:
            # Since start; for a window use the PromQL in docs/operations.md.
            yield _gauge(
                "extproc_prefix_hit_ratio",
                "Matched / requested prefix blocks since start (tier-weighted).",
                r.prefix_blocks_matched / r.prefix_blocks_requested,
            )
        yield from self._collect_endpoints()
        if self.index is not None:
            s = self.index.stats
            yield _counter(
                "extproc_index_writes_dropped",
                "Index writes dropped (queue full).",
                s.writes_dropped,
            )
            yield _counter(
                "extproc_index_write_errors", "Index write batches that failed.", s.write_errors
            )
            yield _counter("extproc_index_lookups", "Index lookups made.", s.lookups)
        if isinstance(self.inflight, SharedInFlight):
            f = self.inflight.stats
            yield _counter(
                "extproc_shared_inflight_errors",
                "Failed exchanges of in-flight counts with Redis.",
                f.errors,
            )
            yield _counter(
                "extproc_shared_inflight_exchanges",
                "Successful exchanges of in-flight counts with Redis.",
                f.exchanges,
            )
            yield _gauge(
                "extproc_shared_inflight_peers",
                "Other picker processes seen at the last exchange.",
                f.peers,
            )
            yield _gauge(
                "extproc_shared_inflight_degraded",
                "1 while peers' in-flight counts are unknown (Redis failing): local counts only.",
                1.0 if self.inflight.is_degraded else 0.0,
            )
        if self.subscriber is not None:
            k = self.subscriber.stats
            for name, doc, value in (
                ("messages", "KV-event messages received.", k.messages),
                ("blocks_stored", "BlockStored blocks ingested.", k.blocks_stored),
                ("blocks_removed", "BlockRemoved blocks ingested.", k.blocks_removed),
                ("malformed", "KV-event frames or events that could not be decoded.", k.malformed),
                ("gaps", "KV-event sequence gaps.", k.gaps),
                ("replayed", "KV-event batches recovered by replay.", k.replayed),
                ("resyncs", "Endpoints rebuilt after an unrecoverable gap.", k.resyncs),
                ("restarts", "Publisher restarts seen (sequence went back).", k.restarts),
                (
                    "rejected",
                    "KV-event messages refused: topic names no pool endpoint, or sent from "
                    "another address than that endpoint's.",
                    k.rejected,
                ),
            ):
                yield _counter(f"extproc_kv_events_{name}", doc, value)
            yield _gauge(
                "extproc_kv_events_lag_seconds",
                "Publisher timestamp to ingestion of the latest KV-event batch (host clocks).",
                k.lag_s,
            )
            # How long since anything arrived at all (a silent publisher shows here).
            now = time.monotonic()
            if k.messages != self._kv_seen[0]:
                self._kv_seen = (k.messages, now)
            yield _gauge(
                "extproc_kv_events_last_message_age_seconds",
                "Seconds since a KV-event message last arrived, or since start when none has "
                "(at scrape resolution).",
                now - self._kv_seen[1],
            )

    def _collect_request_ends(self):
        e = self.ends.stats
        yield _gauge(
            "extproc_request_end_held",
            "Placements held past their ext_proc stream, waiting for the access-log entry.",
            e.held,
        )
        yield _counter(
            "extproc_request_end_expired",
            "Held placements released by max_hold_s: their access-log entry never came.",
            e.expired,
        )
        yield _counter("extproc_access_log_entries", "Access-log entries received.", e.entries)
        yield _counter(
            "extproc_access_log_unmatched",
            "Access-log entries for requests this process did not hold.",
            e.unmatched,
        )
        if self.shared_ends is not None:
            sh = self.shared_ends
            yield _counter(
                "extproc_request_end_forwarded",
                "Unmatched access-log entries published to the other replicas.",
                sh.published,
            )
            yield _counter(
                "extproc_request_end_forward_applied",
                "Holds released by an entry another replica received.",
                sh.applied,
            )
            yield _counter(
                "extproc_request_end_forward_dropped",
                "Entries that could not be published (Redis failing or backlog full).",
                sh.dropped,
            )
        yield _gauge(
            "extproc_access_log_streams", "Access-log streams open now.", self.access_log.streams
        )
        tps = gauge(
            "extproc_prefill_tokens_per_second",
            "Prefill speed learned per endpoint (uncached tokens / time to first byte).",
            ["endpoint"],
        )
        for address, value in self.speeds.snapshot().items():
            tps.add_metric([address], value)
        yield tps

    def _collect_endpoints(self):
        """Per endpoint: scraped-state age and staleness, scrape failures."""
        if self.scraper is None:
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
        for e in self.pool.snapshot():
            a = self.states.age_s(e.address)
            if a is not None:
                age.add_metric([e.address], a)
            stale.add_metric([e.address], 1.0 if self.states.is_stale(e.address) else 0.0)
            failures.add_metric([e.address], self.scraper.failures(e.address))
        yield age
        yield stale
        yield failures
        st = self.scraper.stats
        yield _counter("extproc_scrapes", "Successful endpoint metrics scrapes.", st.scrapes)
        yield _counter("extproc_scrape_failures", "Failed endpoint metrics scrapes.", st.failures)
        inv = counter(
            "extproc_endpoint_cache_invalidations",
            "Endpoints whose index entries were dropped: restart (process start time changed) "
            "or unreachable (a scrape failed).",
            ["reason"],
        )
        for reason in ("restart", "unreachable"):
            inv.add_metric([reason], st.invalidations.get(reason, 0))
        yield inv


def _counter(name: str, doc: str, value: float):
    c = counter(name, doc)
    c.add_metric([], value)
    return c


def _gauge(name: str, doc: str, value: float):
    g = gauge(name, doc)
    g.add_metric([], value)
    return g
