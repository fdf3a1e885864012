"""Command line: `extproc serve | envoy-config | demo`.

The only place that reads flags, installs signal handlers and configures logging; everything
below receives typed settings.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys
from collections.abc import Sequence
from pathlib import Path

import msgspec

from extproc import protocol
from extproc.bootstrap import BootstrapOptions, render_bootstrap
from extproc.config import (
    Settings,
    build_configured_scheduler,
    examine,
    load_settings,
    locate,
    read_document,
)
from extproc.endpoints import parse_endpoints
from extproc.errors import ConfigError
from extproc.logs import configure as configure_logging

log = logging.getLogger("extproc")


def _serve_settings(args: argparse.Namespace) -> Settings:
    settings = load_settings(args.config)
    server = settings.server
    changes = {}
    if args.port is not None:
        changes["port"] = args.port
    if args.health_port is not None:
        changes["health_port"] = args.health_port
    if args.host is not None:
        changes["host"] = args.host
    if args.admin_port is not None:
        changes["admin_port"] = args.admin_port
    if args.admin_host is not None:
        changes["admin_host"] = args.admin_host
    if args.drain_delay is not None:
        changes["drain_delay_s"] = args.drain_delay
    if args.fallbacks is not None:
        changes["fallbacks"] = args.fallbacks
    if args.plaintext:
        changes["plaintext"], changes["tls"] = True, None
    if args.worker_index:
        # Worker i of `--workers N`: ext_proc and health ports are shared (SO_REUSEPORT);
        # the admin port is per worker so each one's counters are scraped.
        admin = changes.get("admin_port", server.admin_port)
        if admin:
            changes["admin_port"] = admin + args.worker_index
    if args.worker_ports is not None:
        # Each worker's own port (not shared): a proxy balancing over them spreads streams.
        changes["worker_port"] = args.worker_ports + (args.worker_index or 0)
    if changes:
        server = msgspec.structs.replace(server, **changes)
    endpoints = settings.endpoints
    if args.endpoints:
        endpoints = [e.strip() for e in args.endpoints.split(",") if e.strip()]
    discovery = settings.discovery
    found = {
        k: v
        for k, v in (
            ("inference_pool", args.inference_pool),
            ("namespace", args.namespace),
            ("kubeconfig", args.kubeconfig),
            ("endpoints_file", args.endpoints_file),
        )
        if v
    }
    if found:
        discovery = msgspec.structs.replace(discovery, **found)
    index = settings.index
    if args.redis_url:
        index = msgspec.structs.replace(index, backend="redis", redis_url=args.redis_url)
    return msgspec.structs.replace(
        settings, server=server, endpoints=endpoints, index=index, discovery=discovery
    )


async def _serve(settings: Settings, *, shared_ports: bool = False) -> None:
    from extproc.server.app import App

    endpoints = parse_endpoints(",".join(settings.endpoints))
    async with App(
        settings, endpoints, environ=os.environ, shared_ports=shared_ports, exit_when_stuck=os._exit
    ) as app:
        loop = asyncio.get_running_loop()
        stopping: set[asyncio.Task[None]] = set()  # held so the drain task is not collected

        def on_signal() -> None:
            if not stopping:
                stopping.add(asyncio.ensure_future(app.stop()))

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, on_signal)
        # App logs "serving" with the ports; this line stays for people reading a terminal.
        log.info(
            "extproc serving ext_proc on :%d, health on :%d, %d endpoint(s)",
            app.port,
            app.health_port,
            len(endpoints),
        )
        await app.serve()


def _run(coro) -> None:
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        asyncio.run(coro)
    else:
        uvloop.run(coro)


def cmd_serve(args: argparse.Namespace) -> int:
    if args.worker_index is not None:
        from extproc.server.workers import die_with_supervisor

        if not die_with_supervisor():
            log.error("the supervisor is gone: worker %d exits", args.worker_index)
            return 1
    settings = _serve_settings(args)
    parse_endpoints(",".join(settings.endpoints))  # fail fast, before binding ports
    if args.workers > 1:
        return _supervise(args, settings)
    from extproc.server.ports import PortInUse

    try:
        _run(_serve(settings, shared_ports=args.worker_index is not None))
    except PortInUse as exc:
        # One line, no traceback: the usual cause is another picker on this host.
        log.error("cannot start: %s", exc)
        return 1
    return 0


def _supervise(args: argparse.Namespace, settings: Settings) -> int:
    from extproc.server.workers import Supervisor, worker_argv

    server = settings.server
    if server.port == 0 or server.health_port == 0:
        raise ConfigError("--workers needs fixed ext_proc and health ports (not 0)")
    if args.worker_ports == 0:
        raise ConfigError("--worker-ports needs a fixed base port (not 0)")
    if settings.index.backend == "memory":
        log.warning(
            "workers do not share state with the memory index: each has its own prefix index "
            "and in-flight counts; use --redis-url to share them"
        )
    elif settings.state.shared_inflight is None:
        log.warning("workers share the Redis index but not in-flight counts (shared_inflight off)")
    sup = Supervisor(
        lambda i: worker_argv(args.argv, i), args.workers, grace_s=server.drain_bound_s
    )
    # SIGTERM (Kubernetes) and SIGINT both drain every worker; the supervisor forwards.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: sup.stop())
    log.info(
        "supervising workers",
        extra={"workers": args.workers, "port": server.port, "health_port": server.health_port},
    )
    return sup.run()


def cmd_envoy_config(args: argparse.Namespace) -> int:
    opts = BootstrapOptions(
        listen_port=args.listen_port,
        listen_address=args.listen_address,
        extproc=args.extproc,
        lb=args.lb,
        endpoints=tuple(e.address for e in parse_endpoints(args.endpoints or "")),
        admin_port=args.admin_port,
        fail_open=args.fail_open,
        retries=args.retries,
        extproc_tls=not args.extproc_plaintext,
        extproc_sni=args.extproc_sni,
        extproc_ca_file=args.extproc_ca,
        allow_explain=args.allow_explain,
        extproc_workers=args.extproc_workers,
        response_headers=args.response_headers,
        response_trailers=args.response_trailers,
        access_log_flush_s=args.access_log_flush_s,
    )
    try:
        sys.stdout.write(render_bootstrap(opts))
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return 0


def check_report(path: str | Path) -> tuple[str, int]:
    """`extproc check-config`: every problem with file:line, how each llm-d plugin is
    realised, what runs degraded; exit code 0 (serves as is) or 2 (it would not)."""
    try:
        text, doc = read_document(path)
    except ConfigError as exc:
        return f"{exc}\n", 2
    ex = examine(doc)
    out: list[str] = []
    if ex.problems:
        out.append(f"{path}: {len(ex.problems)} problem(s)")
        out.extend(f"  {locate(path, text, p, bare=not ex.wrapped)}" for p in ex.problems)
    else:
        out.append(f"{path}: OK")
    if ex.translation and ex.translation.realised:
        out.append("plugins:")
        for r in ex.translation.realised:
            label = r.name if r.name == r.type else f"{r.name} ({r.type})"
            out.append(f"  {label}: {r.how}")
            out.extend(f"    - {n}" for n in r.notes)
    for note in ex.notes:
        out.append(f"note: {note}")
    for d in ex.degraded:
        out.append(f"DEGRADED: {d}")
    if ex.settings is not None:
        out.append("profiles:")
        scheduler = build_configured_scheduler(ex.settings)
        for name, profile in scheduler.profiles.items():
            scorers = ", ".join(f"{s.name} x{s.weight:g}" for s in profile.scorers) or "none"
            filters = ", ".join(f.name for f in profile.filters) or "none"
            out.append(
                f"  profile {name}: filters [{filters}], scorers [{scorers}], "
                f"picker {profile.picker.type_name}"
            )
    return "\n".join(out) + "\n", 2 if ex.problems else 0


def cmd_check_config(args: argparse.Namespace) -> int:
    text, code = check_report(args.file)
    (sys.stdout if code == 0 else sys.stderr).write(text)
    return code


def cmd_plugins(args: argparse.Namespace) -> int:
    import msgspec

    from extproc.scheduling.registry import PluginRegistry

    registry = PluginRegistry.default()
    for name, doc in registry.describe():
        print(f"{name}\n" + "\n".join(f"    {line}" for line in doc.splitlines()))
        # Read from the plugin's Params, so the list cannot drift from what is accepted.
        params = [
            f"{key} {'required' if d is msgspec.NODEFAULT else _yaml_value(d)}"
            for key, d in registry.parameters(name)
        ]
        print("    parameters (default): " + (", ".join(params) if params else "none") + "\n")
    return 0


def _yaml_value(value: object) -> str:
    import json

    import msgspec

    # JSON is YAML's flow style: `null`, `true`, `"5m"`, `{"decode": "decode"}`.
    return json.dumps(msgspec.to_builtins(value))


def cmd_explain(args: argparse.Namespace) -> int:
    # The standard library's client: `explain` ships with the base install.
    import urllib.error
    import urllib.request

    body = sys.stdin.buffer.read() if args.body == "-" else Path(args.body).read_bytes()
    headers = {"content-type": "application/json", protocol.EXPLAIN_PATH_HEADER: args.path}
    for h in args.header or []:
        name, _, value = h.partition(":")
        headers[name.strip()] = value.strip()
    url = f"{args.picker.rstrip('/')}/debug/explain"
    req = urllib.request.Request(url, data=body, headers=headers, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:
            print(resp.read().decode())
            return 0
    except urllib.error.HTTPError as err:
        print(err.read().decode())
        return 1


def cmd_demo(args: argparse.Namespace) -> int:
    try:
        from extproc.demo import run_demo
    except ImportError as exc:
        print(f"extproc demo: {exc.name} is missing: pip install 'extproc[demo]'", file=sys.stderr)
        return 2

    return run_demo(
        requests=args.requests,
        upstreams=args.upstreams,
        rate=args.rate,
        fast=args.fast,
        seed=args.seed,
        chart=None if args.no_chart else args.chart,
    )


def _log_flags(p: argparse.ArgumentParser, *, defaults: bool) -> None:
    # Accepted before and after the subcommand; the subcommand's copy must not reset a value
    # given before it, hence SUPPRESS there.
    p.add_argument(
        "--log-level",
        default="INFO" if defaults else argparse.SUPPRESS,
        help="DEBUG, INFO, WARNING or ERROR (default INFO)",
    )
    p.add_argument(
        "--log-format",
        choices=("json", "text"),
        default="text" if defaults else argparse.SUPPRESS,
        help="json: one object per line (ts, level, logger, message, request_id); default text",
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="extproc", description=__doc__)
    # Defaults shown in help come from where they are defined, never restated.
    srv, env = Settings().server, BootstrapOptions()
    _log_flags(p, defaults=True)
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="serve Envoy ext_proc (the endpoint picker)")
    _log_flags(s, defaults=False)
    s.add_argument(
        "--workers",
        type=int,
        default=1,
        help="processes sharing the ext_proc and health ports (SO_REUSEPORT); worker i serves "
        "admin on admin-port + i (default 1: no supervisor)",
    )
    s.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    s.add_argument(
        "--worker-ports",
        type=int,
        default=None,
        help="worker i also serves ext_proc alone on WORKER_PORTS + i, for a proxy that "
        "balances streams over the workers (envoy-config --extproc-workers)",
    )
    s.add_argument("--endpoints", help="comma list of model-server ip:port")
    s.add_argument("--port", type=int, help=f"ext_proc gRPC port (default {srv.port})")
    s.add_argument("--health-port", type=int, help=f"gRPC health port (default {srv.health_port})")
    s.add_argument("--host", help=f"address to bind (default {srv.host})")
    s.add_argument(
        "--admin-port", type=int, help=f"metrics + debug API port (default {srv.admin_port})"
    )
    s.add_argument(
        "--admin-host",
        help=f"address the admin port binds (default {srv.admin_host}; 0.0.0.0 exposes it: "
        "no auth)",
    )
    s.add_argument(
        "--fallbacks", type=int, help="extra endpoints after the pick (override-host mode)"
    )
    s.add_argument(
        "--drain-delay", type=float, help="seconds still serving after SIGTERM (default 3)"
    )
    s.add_argument(
        "--plaintext",
        action="store_true",
        help="serve ext_proc without TLS (default: TLS, self-signed unless server.tls names "
        "certificate files)",
    )
    s.add_argument("--redis-url", help="share the KV-block index and in-flight load in Redis")
    s.add_argument("--inference-pool", help="watch this Kubernetes InferencePool for endpoints")
    s.add_argument("--namespace", help="the InferencePool's namespace (default: the pod's)")
    s.add_argument("--kubeconfig", help="kubeconfig to use outside a cluster")
    s.add_argument("--endpoints-file", help="YAML/JSON endpoint list, re-read on change")
    s.add_argument("--config", help="YAML settings or an llm-d EndpointPickerConfig")
    s.set_defaults(func=cmd_serve)

    e = sub.add_parser("envoy-config", help="print an Envoy bootstrap for this picker")
    e.add_argument("--listen-port", type=int, default=env.listen_port)
    e.add_argument("--listen-address", default=env.listen_address)
    e.add_argument("--extproc", default=env.extproc, help="picker host:port")
    e.add_argument("--lb", choices=("original-dst", "override-host"), default="original-dst")
    e.add_argument("--endpoints", help="model-server ip:port list (needed for override-host)")
    e.add_argument("--admin-port", type=int, help="expose Envoy's admin on 127.0.0.1:PORT")
    e.add_argument("--fail-open", action="store_true", help="failure_mode_allow: true")
    e.add_argument(
        "--retries",
        type=int,
        default=2,
        help="retries of a request that failed before any response byte (connect failure, "
        "reset, refused stream), in both --lb modes: override-host tries the next endpoint "
        "of the picker's list, original-dst the same address again; 0: no retry policy, "
        "and so no per-try idle timeout either",
    )
    e.add_argument(
        "--extproc-tls",
        action="store_true",
        help="TLS to the picker: the default, kept for old command lines; without "
        "--extproc-ca the certificate is not verified (what a self-signed picker needs)",
    )
    e.add_argument(
        "--extproc-plaintext",
        action="store_true",
        help="plaintext to the picker (only for a picker started with --plaintext)",
    )
    e.add_argument(
        "--extproc-workers",
        type=int,
        default=1,
        help="the picker runs --workers N --worker-ports P and --extproc is host:P: balance "
        "streams over the N worker ports",
    )
    e.add_argument("--extproc-sni", help="SNI sent to the picker (default: its host name)")
    e.add_argument("--extproc-ca", help="PEM CA bundle to verify the picker's certificate")
    e.add_argument(
        "--allow-explain",
        action="store_true",
        help="let x-extproc-explain/x-extproc-decision cross the edge (trusted callers only)",
    )
    e.add_argument(
        "--response-headers",
        choices=("auto", "send", "skip"),
        default="send",
        help="send the response headers to the picker (default); auto: skip them when the "
        "access log reports request ends, explanations are off and a request has one "
        "address (-14 to -18%% picker CPU; not with flow control or profiles that add "
        "response headers: docs/gateways.md)",
    )
    e.add_argument(
        "--response-trailers",
        choices=("skip", "send"),
        default="skip",
        help="send the response trailers to the picker: the ext_proc stream then lasts to "
        "each response's end, so flow control's eviction (enableEviction) can cut a "
        "response under way; skip (default): only until the response headers, before a "
        "streamed request is even scheduled (docs/flow-control.md#eviction)",
    )
    e.add_argument(
        "--access-log-flush-s",
        type=float,
        default=BootstrapOptions().access_log_flush_s,
        help="how often Envoy flushes its access log to the picker (seconds; default "
        "%(default)s): the picker hears of a request's end that much late at most, and "
        "queued work waits that long for the room it freed (bench/RESULTS.md, seventeenth "
        "and eighteenth sessions)",
    )
    e.set_defaults(func=cmd_envoy_config)

    c = sub.add_parser("check-config", help="validate a config file without serving")
    c.add_argument("file")
    c.set_defaults(func=cmd_check_config)

    pl = sub.add_parser("plugins", help="list the scheduling plugins and their parameters")
    pl.set_defaults(func=cmd_plugins)

    x = sub.add_parser("explain", help="replay a request against a running picker's state")
    x.add_argument("body", help="request body file, or - for stdin")
    x.add_argument(
        "--picker", default=f"http://127.0.0.1:{srv.admin_port}", help="the picker's admin URL"
    )
    x.add_argument("--path", default="/v1/chat/completions")
    x.add_argument("-H", "--header", action="append", help="extra request header 'name: value'")
    x.set_defaults(func=cmd_explain)

    # `extproc sim ...` is handed to the simulator's own parser whole (see main()).
    sub.add_parser("sim", help="run simulated vLLM servers (extproc sim --help)")

    d = sub.add_parser("demo", help="Envoy + extproc + simulated vLLM: routing policies compared")
    d.add_argument("--requests", type=int, default=None, help="per policy (default 300)")
    d.add_argument("--upstreams", type=int, default=3, help="simulated vLLM servers")
    d.add_argument("--rate", type=float, default=None, help="requests/s, Poisson (default 25)")
    d.add_argument("--fast", type=float, default=None, help="sim time compression (default 10)")
    d.add_argument("--seed", type=int, default=None, help="workload seed (default 7)")
    d.add_argument("--chart", default="extproc-demo.png", help="PNG chart path")
    d.add_argument("--no-chart", action="store_true", help="skip the PNG chart")
    d.set_defaults(func=cmd_demo)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["sim"]:
        from extproc.sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # `--workers` re-runs this command line in each worker
    worker = getattr(args, "worker_index", None)
    fields = {"worker": worker} if worker is not None else None
    try:
        configure_logging(args.log_level, args.log_format, fields=fields)
    except ValueError as exc:
        print(f"extproc: {exc}", file=sys.stderr)
        return 2
    # One line per HTTP call from the demo's client would bury what the demo shows.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"extproc: configuration error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
