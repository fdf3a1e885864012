"""Start, serve and drain one picker process (the parts of server/assembly.py).

Start order: index (warms Redis up), discovery, background loops, then every port is bound
before any listens, and readiness turns SERVING once endpoints are known. `stop()` (what
SIGTERM calls) ends the streams held open only for eviction (server/cut_streams.py), marks
health NOT_SERVING, lets open streams finish within `grace_s`, or `response_grace_s` while a
response body streams through the picker (server/drain.py; Envoy's access-log streams,
which never finish by themselves, are closed once the ext_proc ones have), then tears down
in reverse order: servers -> loops -> queued index writes -> clients.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Self

import grpc
from aiohttp import web

from extproc import protocol
from extproc.backoff import backoff_s
from extproc.config import Settings
from extproc.core import Endpoint
from extproc.endpoints.shared_inflight import SharedInFlight
from extproc.errors import ConfigError
from extproc.redis_loop import stop
from extproc.server import exporter, wire
from extproc.server import families as fam
from extproc.server.admin import make_admin_app
from extproc.server.assembly import Parts
from extproc.server.drain import DrainBounds, DrainStats, drain
from extproc.server.guard import lenient_deserializer
from extproc.server.ports import PortInUse, bind_grpc, bind_worker_port, check_ports
from extproc.server.stream import StreamHandler
from extproc.server.watchdog import LoopWatchdog, WatchdogBounds, WatchdogStats

log = logging.getLogger("extproc.server")

# Keepalive so a proxy that vanished without closing its connection frees its streams.
_SERVER_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
)


# A crashed background loop runs again after this, doubled per crash in a row, at most the cap.
LOOP_RESTART_S = 1.0
LOOP_RESTART_CAP_S = 60.0


@dataclass(slots=True)
class LoopStats:
    """Background loops that ended in an exception, by name (`crashes`): each crash is
    logged with its traceback and the loop is started again after a backoff."""

    crashes: dict[str, int] = field(default_factory=dict)


class Lifecycle(Parts):
    def __init__(
        self,
        settings: Settings,
        endpoints: Sequence[Endpoint],
        *,
        environ: Mapping[str, str] | None = None,
        shared_ports: bool = False,
        grpc_ports: frozenset[str] = frozenset({"ext_proc", "health"}),
        exit_when_stuck: Callable[[int], object] | None = None,
    ) -> None:
        """`shared_ports`: a `--workers` worker, whose ext_proc and health ports are shared
        with its siblings (SO_REUSEPORT); otherwise a second process on the same port is a
        conflict. `grpc_ports`: which of the ext_proc and health ports this process serves on
        grpc.aio; another transport serves the rest and calls the same
        handlers (`stream_handler`, `access_log`, `health`; bench/picker_pyvoy.py measures
        pyvoy that way). `exit_when_stuck`: how the process ends itself when its loop
        stays stuck for `server.loop_stall_exit_s` (server/watchdog.py; the CLI passes
        `os._exit`); None only logs and counts stalls (a picker embedded in another
        process, such as a test's)."""
        super().__init__(settings, endpoints, environ=environ)
        self._shared_ports = shared_ports
        self._grpc_ports = grpc_ports
        self.stream_handler: StreamHandler | None = None
        self._bound = False
        self._server: grpc.aio.Server | None = None
        self._health_server: grpc.aio.Server | None = None
        self._admin: web.AppRunner | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._exits = contextlib.AsyncExitStack()
        # Kubernetes watches by resource, for their stats (server/exporter.py).
        self.kube_watches: dict[str, object] = {}
        self.loop_stats = LoopStats()
        # Stats of what starts with the process, by export table (server/exporter.py reads
        # this list at each scrape, so parts added at start show from then on).
        self.drain_stats = DrainStats()
        self.watchdog_stats = WatchdogStats()
        self.running_stats: list[tuple[fam.StatsFamilies, Any]] = [
            (fam.LOOPS, self.loop_stats),
            (fam.DRAIN, self.drain_stats),
            (fam.LOOP_WATCH, self.watchdog_stats),
        ]
        cfg = settings.server
        self._watchdog = LoopWatchdog(
            WatchdogBounds(cfg.loop_stall_s, cfg.loop_stall_exit_s),
            self.watchdog_stats,
            exit=exit_when_stuck,
        )
        self._endpoints_changed = asyncio.Event()
        self._stopped = asyncio.Event()
        self._stopping = False
        # Set when certificate files are served (reload counters).
        self.tls_reloader: object | None = None
        self.port = 0
        self.worker_port = 0  # this process's own ext_proc port (--worker-ports)
        self.health_port = 0
        self.admin_port = 0
        # Every component's stats on /metrics, with this process's readiness and watches.
        exporter.register(self, self.ready, self.kube_watches, self.running_stats)

    def set_endpoints(self, endpoints: Sequence[Endpoint]) -> None:
        """Discovery's callback: swap the pool now (the next request sees it); follow-up work
        that needs awaiting runs in the reconcile loop."""
        self.pool.replace(endpoints)
        self._endpoints_changed.set()

    async def _reconcile(self) -> None:
        """Follow pool changes: KV-event subscriptions, index entries and calibration windows
        of endpoints that left, readiness."""
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
                    self.subscriber.watch(self.event_source(e))
            for gone in before - after:
                self.subscriber.unwatch(gone)
        for gone in before - after:
            self.calibration.forget(gone)
            if self.silence is not None:
                self.silence.forget(gone)
        if self.index is not None:
            for gone in before - after:
                await self.index.remove_endpoint(gone)
        for gone in before - after:
            await self.router.forget_endpoint(gone)
        await self.health.set_ready(self.ready())
        return after

    def ready(self) -> bool:
        """Ready once endpoints are known (discovery has synced) and while not draining."""
        synced = all(w.synced.is_set() for w in self.watches)
        return self._bound and synced and len(self.pool) > 0 and not self._stopping

    async def _start_discovery(self) -> None:
        d = self.settings.discovery
        if d.endpoints_file:
            from extproc.endpoints.filewatch import EndpointFileWatch, load_endpoint_file

            self.pool.replace(load_endpoint_file(d.endpoints_file))
            watch = EndpointFileWatch(d.endpoints_file, self.set_endpoints)
            self.watches.append(watch)
            self.running_stats.append((fam.FILE_WATCH, watch.stats))
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
            self.running_stats.append((fam.API_SERVER, api.stats))
            k8s = InferencePoolWatch(api, namespace, d.inference_pool, self.set_endpoints)
            self.watches.append(k8s)
            self.kube_watches["inferencepool"] = k8s
            self.spawn("inferencepool-watch", k8s.run)
            if self.admission is not None and self.admission.objectives.path is None:
                from extproc.endpoints.objectives_watch import InferenceObjectiveWatch

                objectives = InferenceObjectiveWatch(
                    api, namespace, d.inference_pool, self.admission.objectives.replace
                )
                self.kube_watches["inferenceobjective"] = objectives
                self.spawn("inferenceobjective-watch", objectives.run)
            self.spawn("readiness", self._ready_when_synced)

    async def _ready_when_synced(self) -> None:
        for w in self.watches:
            await w.synced.wait()
        self._endpoints_changed.set()

    def spawn(self, name: str, loop: Callable[[], Awaitable[None]]) -> None:
        """Run a background loop until stop; a crash is logged, never silent, and the loop
        runs again after `LOOP_RESTART_S` doubled per crash in a row (capped). Before, a
        crashed loop stayed down until the process restarted: a bug met once (a scrape
        body, a peer's entry) left what the loop fed (figures, KV events, shared state)
        stale for the process's life, with a serving picker routing on it. A loop that
        returns has finished its work (`readiness`): it is not run again."""

        async def guarded() -> None:
            in_a_row = 0
            while True:
                started = asyncio.get_running_loop().time()
                try:
                    await loop()
                    return
                except asyncio.CancelledError:
                    raise
                except Exception:
                    crashes = self.loop_stats.crashes
                    crashes[name] = crashes.get(name, 0) + 1
                    # A loop that ran a while before crashing starts its backoff afresh.
                    ran = asyncio.get_running_loop().time() - started
                    in_a_row = 1 if ran > LOOP_RESTART_CAP_S else in_a_row + 1
                    delay = backoff_s(in_a_row, LOOP_RESTART_S, LOOP_RESTART_CAP_S)
                    log.exception(
                        "background loop %s crashed; restarting in %.0f s",
                        name,
                        delay,
                        extra={"loop": name, "crashes": crashes[name]},
                    )
                await asyncio.sleep(delay)

        self.loop_stats.crashes.setdefault(name, 0)  # a series from the start, for alerts
        self._tasks.append(asyncio.create_task(guarded(), name=name))

    async def __aenter__(self) -> Self:
        cfg = self.settings.server
        # Before anything connects or binds: a taken port is one clear error, not a
        # traceback after the ext_proc port already took streams. Workers share two ports.
        ports = {"ext_proc": cfg.port, "health": cfg.health_port}
        # In this order: the ext_proc port is the one named when both are taken.
        served = {k: v for k, v in ports.items() if k in self._grpc_ports}
        shared = {} if self._shared_ports else served
        own = {"worker": cfg.worker_port or 0} if "ext_proc" in self._grpc_ports else {}
        check_ports(cfg.host, {**shared, **own, "admin": cfg.admin_port or 0})
        try:
            await self._start(cfg)
            return self
        except BaseException:
            if not self._bound:
                # Never served: nothing to drain, close at once.
                for server in (self._server, self._health_server):
                    if server is not None:
                        await server.stop(0)
                self._server = self._health_server = None
            await self.stop()
            raise

    def _start_loops(self) -> None:
        """Every background loop, with the clients closed after the loops stop."""
        self.spawn("endpoints", self._reconcile)
        if self.scraper is not None:
            self.spawn("metrics-scraper", self.scraper.run)
        if self.dcgm is not None:
            self.spawn("dcgm", self.dcgm.run)
        if isinstance(self.inflight, SharedInFlight):
            self.spawn("shared-inflight", self.inflight.run)
            # Closed after the loops stop: withdraws this process's load from Redis at once.
            self._exits.push_async_callback(self.inflight.aclose)
        if self.inflight_push is not None:
            self.spawn("inflight-push", self.inflight_push.run)
            self._exits.push_async_callback(self.inflight_push.aclose)
        if self.subscriber is not None:
            self.spawn("kv-events", self.subscriber.run)
        if self.silence is not None:
            self.spawn("kv-events-silence", self.silence.run)
        for i, learner in enumerate(self.latency):
            self.spawn(f"latency-learner-{i}", learner.run)
        if self.admission is not None:
            self.spawn("flow-control", self.admission.run)
            if self.admission.shared is not None:
                self.spawn("flow-control-shared", self.admission.shared.run)
                self._exits.push_async_callback(self.admission.aclose)
        self.spawn("request-end-sweep", self._sweep_request_ends)
        if self.shared_ends is not None:
            self.spawn("shared-request-ends", self.shared_ends.run)
            self._exits.push_async_callback(self.shared_ends.aclose)
        if self.shared_sessions is not None:
            self.spawn("shared-sessions", self.shared_sessions.run)
            self._exits.push_async_callback(self.shared_sessions.aclose)
        if self.shared_growth is not None:
            self.spawn("shared-growth", self.shared_growth.run)
            self._exits.push_async_callback(self.shared_growth.aclose)
        if self.shared_observations is not None:
            self.spawn("shared-observations", self.shared_observations.run)
            self._exits.push_async_callback(self.shared_observations.aclose)
        if self.shared_placements is not None:
            self.spawn("shared-placements", self.shared_placements.run)
            self._exits.push_async_callback(self.shared_placements.aclose)
        if self.shared_silence is not None:
            self.spawn("shared-silence", self.shared_silence.run)
            self._exits.push_async_callback(self.shared_silence.aclose)
        if self.shared_scrapes is not None:
            self.spawn("shared-scrapes", self.shared_scrapes.run)
            self._exits.push_async_callback(self.shared_scrapes.aclose)
        if self.shared_calibration is not None:
            self.spawn("shared-calibration", self.shared_calibration.run)
            self._exits.push_async_callback(self.shared_calibration.aclose)

    async def _start(self, cfg) -> None:
        handler = StreamHandler.from_settings(self.router, cfg, self.metrics)
        self.stream_handler = handler
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
        self._start_loops()
        # NOT_SERVING from the first probe: the health servicer answers SERVING for "" by
        # default, which would let a proxy send traffic before endpoints are known.
        await self.health.set_ready(False)
        # SO_REUSEPORT only between workers: otherwise a second picker would share the port
        # silently and take half the streams.
        reuse = (("grpc.so_reuseport", int(self._shared_ports)),)
        tls = cfg.effective_tls
        if "ext_proc" in self._grpc_ports:
            self._server = grpc.aio.server(options=_SERVER_OPTIONS + reuse)
            self._server.add_generic_rpc_handlers((generic, self.access_log.rpc_handler()))
            self.health.add_to(self._server)
            address = f"{cfg.host}:{cfg.port}"
            if tls is not None:
                from extproc.server.tls import port_credentials

                creds, self.tls_reloader = port_credentials(tls)
                self.port = bind_grpc("ext_proc", address, self._server.add_secure_port, creds)
            else:
                self.port = bind_grpc("ext_proc", address, self._server.add_insecure_port)
            if cfg.worker_port is not None:
                self.worker_port = bind_worker_port(self._server, cfg, creds if tls else None)
        if "health" in self._grpc_ports:
            # Plaintext on purpose: kubelet's gRPC probes have no TLS option. It serves only
            # the health service, so it carries no request data.
            self._health_server = grpc.aio.server(options=reuse)
            self.health.add_to(self._health_server)
            health_address = f"{cfg.host}:{cfg.health_port}"
            self.health_port = bind_grpc(
                "health", health_address, self._health_server.add_insecure_port
            )
        # Every port is bound before any starts listening (the admin site binds as it starts).
        if cfg.admin_port is not None:
            await self._start_admin(cfg)
        for server in (self._health_server, self._server):
            if server is not None:
                await server.start()
        self._bound = True
        # Serving from here on: a stuck loop now holds streams (server/watchdog.py).
        self._watchdog.start()
        await self.health.set_ready(self.ready())
        self.signals.announce()
        if self.calibration_pooling is not None:
            log.info(self.calibration_pooling)
        if self.scrape_sharing is not None:
            log.info(self.scrape_sharing)
        if self.observation_sharing is not None:
            log.info(self.observation_sharing)
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

    async def _start_admin(self, cfg) -> None:
        admin = make_admin_app(
            self.router, self.metrics, self.signals, max_body_bytes=cfg.admin_explain_max_bytes
        )
        self._admin = web.AppRunner(admin, access_log=None)
        await self._admin.setup()
        site = web.TCPSite(self._admin, cfg.admin_host, cfg.admin_port)
        try:
            await site.start()
        except OSError as exc:
            raise PortInUse("admin", cfg.admin_host, cfg.admin_port, exc.strerror or "") from None
        self.admin_port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]

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
        streams finish for up to `grace_s` (`response_grace_s` while a response body streams
        through the picker: server/drain.py), then close."""
        if self._stopping:
            await self._stopped.wait()
            return
        self._stopping = True
        if self.stream_handler is not None:
            # Streams held open past their response headers only so eviction could cut them
            # end with OK now: Envoy resets a response whose stream is still open when the
            # grace ends (fail-closed); ended here, it runs on to its end.
            self.stream_handler.cuts.release_all()
        await self.health.set_ready(False)
        if self.settings.server.drain_delay_s and self._server is not None:
            # Still serving while NOT_SERVING propagates: refusing at once would fail the
            # streams Envoy keeps sending until its health check notices.
            await asyncio.sleep(self.settings.server.drain_delay_s)
        if self._server is not None:
            cfg = self.settings.server
            handler = self.stream_handler
            stopping = asyncio.ensure_future(
                drain(
                    self._server,
                    lambda: [s.phase for s in handler.live] if handler is not None else [],
                    DrainBounds(cfg.grace_s, cfg.response_grace_s),
                    self.drain_stats,
                )
            )
            await self._end_access_logs_when_idle(stopping)
            await stopping
        if self._health_server is not None:
            await self._health_server.stop(0)
        if self._admin is not None:
            await self._admin.cleanup()
        # Bounded: a loop that swallowed its cancellation is named in a log line, not waited
        # on forever (extproc/redis_loop.py says how redis-py can swallow one).
        await stop(self._tasks)
        await self._exits.aclose()
        self._watchdog.stop()
        self._stopped.set()

    async def _end_access_logs_when_idle(self, stopping: asyncio.Future[None]) -> None:
        """Once no ext_proc stream is open, close Envoy's access-log streams: they last as
        long as Envoy's connection, so grpc's stop would otherwise hold every drain for the
        whole grace. The entries still owed end requests this process no longer routes."""
        handler = self.stream_handler
        while not stopping.done() and handler is not None and handler.open_streams:
            await asyncio.sleep(0.05)
        self.access_log.end()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()
