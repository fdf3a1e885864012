"""What extproc adds to a request through Envoy, measured in one run, exchange by exchange.

Every configuration fronts the same echo upstream: Envoy alone (no ext_proc filter); Envoy +
the floor processor (`bench/floor_processor.py`, the least a picker can do on the same
transport) and Envoy + extproc, each in the FULL_DUPLEX_STREAMED exchange (gateways, body
echoed) and in the BUFFERED one (no echo); and sglang-router (a Rust in-path router, its
cache_aware policy) when it can be installed into a temporary venv. Picker configurations use
the defaults of `extproc envoy-config`: TLS to the picker and the access-log stream.

`wrk` drives each configuration in turn, round after round (A, B, C, A, B, C, ...: load from
other processes hits all alike), and the table gives medians over rounds: p50/p99 latency and
the CPU of the picker (or router) per request (user+system from /proc / requests served),
and of the Envoy in front of it. `--only 'extproc FD,extproc FD-flush20'`: the access log
flushed every 20 ms against `envoy-config`'s default, alternating (what hearing of ends
sooner costs).

    apt-get install wrk   # once (no install step of the repo provides it: bench/README.md)
    uv run python bench/bench_proxy.py [--seconds 5] [--rounds 3] [--sizes 1,100] [--conns 1,16]
    uv run python bench/bench_proxy.py --big   # 220 KB prompts, 150 connections, errors counted
    # old vs new in one run, at the same offered load (each connection pauses 50 ms):
    uv run python bench/bench_proxy.py --baseline-src ../main --think-ms 50 --only ...
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import httpx
import orjson
import yaml
from grpc_health.v1 import health_pb2
from sglang_peer import install_sglang  # bench/sglang_peer.py (bench/ is on the path)

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.gateways import LLM_D, gateway_bootstrap
from extproc.stack import (
    Stack,
    StackOptions,
    envoy_binary,
    free_port,
    grpc_health_status,
    wait_until,
)

TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def chat_body(size: int) -> bytes:
    filler = "The quick brown fox jumps over the lazy dog. "
    text = (filler * (size // len(filler) + 1))[: max(0, size - 80)]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime


@dataclass
class WrkResult:
    requests: int
    p50_ms: float
    p99_ms: float
    rps: float
    non_2xx: int


_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3}


def _ms(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(us|ms|s)", text)
    assert m, text
    return float(m.group(1)) * _UNITS[m.group(2)]


_NO_WRK = (
    "{script} drives its load with wrk, which is not on PATH: install the wrk package "
    "(Debian/Ubuntu: apt-get install wrk) and run it again. No install step of this repo "
    "provides it (see bench/README.md)."
)


def require_wrk() -> None:
    """Exit at once with a line naming the package when `wrk` is missing: every bench that
    calls `run_wrk` starts with this, before it starts Envoy, pickers and upstreams, rather
    than failing in the middle of its first round."""
    if shutil.which("wrk") is None:
        raise SystemExit(_NO_WRK.format(script=Path(sys.argv[0]).name or "this bench"))


def run_wrk(
    url: str, body_file: Path, conns: int, seconds: float, think_ms: float = 0
) -> WrkResult:
    """`think_ms` > 0: each connection waits that long before its next request, so every
    configuration gets about the same offered load (conns / (think + latency)) instead of
    as much as it can take (closed loop). A caller that did not start with `require_wrk`
    still gets its line, not a traceback, if `wrk` is missing."""
    require_wrk()
    script = body_file.with_suffix(".lua")
    script.write_text(
        f'local f = io.open("{body_file}", "rb"); wrk.body = f:read("*all"); f:close()\n'
        'wrk.method = "POST"\nwrk.headers["Content-Type"] = "application/json"\n'
        + (f"function delay() return {think_ms:g} end\n" if think_ms > 0 else "")
    )
    out = subprocess.run(
        [
            "wrk",
            "-t1",
            f"-c{conns}",
            f"-d{max(1, round(seconds))}s",
            "--latency",
            "-s",
            str(script),
            f"{url}/v1/chat/completions",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    if "requests in" not in out:
        raise RuntimeError(f"wrk said: {out[-500:]}")
    pct = dict(re.findall(r"^\s+(50|99)(?:\.0+)?%\s+(\S+)", out, re.M))
    reqs = int(re.search(r"(\d+) requests in", out).group(1))
    non2xx = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))
    return WrkResult(
        reqs, _ms(pct["50"]), _ms(pct["99"]), rps, int(non2xx.group(1)) if non2xx else 0
    )


def start_envoy(doc: dict, workdir: Path, name: str) -> tuple[subprocess.Popen, str]:
    listener = doc["static_resources"]["listeners"][0]["address"]["socket_address"]
    admin = doc["admin"]["address"]["socket_address"]["port_value"]
    cfg = workdir / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(
        [
            envoy_binary(),
            "-c",
            str(cfg),
            "--disable-hot-restart",
            "--concurrency",
            "1",
            "--log-level",
            "warn",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{admin}/ready").status_code == 200,
        timeout_s=30,
        what=f"{name} envoy",
        proc=proc,
    )
    return proc, f"http://127.0.0.1:{listener['port_value']}"


def bootstrap(**kw) -> dict:
    return build_bootstrap(
        BootstrapOptions(
            listen_port=free_port(), listen_address="127.0.0.1", admin_port=free_port(), **kw
        )
    )


def baseline_doc(upstream: str) -> dict:
    """Envoy with the same listener but no ext_proc filter, to one static upstream."""
    doc = bootstrap(lb="override-host", endpoints=(upstream,), access_log=False)
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = [
        f for f in hcm["http_filters"] if f["name"] != "envoy.filters.http.ext_proc"
    ]
    del doc["static_resources"]["clusters"][0]["load_balancing_policy"]
    return doc


def measure(
    url: str,
    body: Path,
    conns: int,
    seconds: int,
    pid: int | None,
    think_ms: float = 0,
    envoy_pid: int | None = None,
) -> tuple[WrkResult, float, float]:
    """The run, and CPU ms per request of the charged process and of its Envoy."""
    run_wrk(url, body, conns, 1, think_ms)  # warm up connections and caches
    pids = (pid, envoy_pid)
    cpu0 = [cpu_seconds(p) if p else 0.0 for p in pids]
    res = run_wrk(url, body, conns, seconds, think_ms)
    n = max(res.requests, 1)
    cpu_ms, envoy_ms = (
        (cpu_seconds(p) - c0) / n * 1e3 if p else 0.0 for p, c0 in zip(pids, cpu0, strict=True)
    )
    return res, cpu_ms, envoy_ms


@dataclass
class Target:
    name: str
    url: str
    pid: int | None  # the process whose CPU is charged (picker, floor, router); None: Envoy
    envoy_pid: int | None = None  # its Envoy (none for a router that is not behind one)


def start_sglang(venv: Path, upstream: str, work: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    log = open(work / "sglang-router.log", "ab")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router",
         "--worker-urls", f"http://{upstream}", "--policy", "cache_aware",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    wait_until(
        lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200,
        timeout_s=60, what="sglang-router", proc=proc,
    )  # fmt: skip
    return proc, f"http://127.0.0.1:{port}"


def picker_doc(
    port: int,
    mode: str,
    *,
    tls: bool,
    response_headers: str = "auto",
    access_log_flush_s: float = BootstrapOptions().access_log_flush_s,
    response_trailers: str = "skip",
) -> dict:
    return bootstrap(
        response_trailers=response_trailers,
        extproc=f"127.0.0.1:{port}",
        request_body_mode=mode,
        extproc_tls=tls,
        extproc_sni="localhost",
        response_headers=response_headers,
        access_log_flush_s=access_log_flush_s,
    )


def start_baseline_picker(src: Path, upstream: str, work: Path) -> tuple[subprocess.Popen, int]:
    """`extproc serve` from another checkout (run from it, so its package wins the import),
    with the stack picker's flags: the same endpoint, TLS, access log."""
    port, health, admin = free_port(), free_port(), free_port()
    log = open(work / "extproc-base.log", "ab")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "extproc", "serve", "--endpoints", upstream,
         "--host", "127.0.0.1", "--port", str(port), "--health-port", str(health),
         "--admin-port", str(admin), "--drain-delay", "0.0", "--fallbacks", "0"],
        cwd=src, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env={**os.environ, "PYTHONPATH": str(src), "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip
    log.close()
    wait_until(
        lambda: grpc_health_status(health, "readiness") == health_pb2.HealthCheckResponse.SERVING,
        timeout_s=60, what="baseline extproc", proc=proc,
    )  # fmt: skip
    return proc, port


# `<who> <FD|BUF>-flush<ms>`: the picker's access log flushed every <ms> instead of
# `envoy-config`'s default (what hearing of ends sooner costs Envoy and the picker).
_FLUSH = re.compile(r"(extproc) (FD|BUF)-flush(\d+)")

# Both keep the response-header phase (`envoy-config`'s default, the gateways' exchange);
# `-skip` / `-send` variants, when named, set `--response-headers` explicitly.
_RESPONSE_HEADERS = {"floor": "send", "extproc": "send"}
_VARIANTS = {"skip": "skip", "send": "send"}
# `<who> <FD|BUF>-trailers`: `--response-trailers send` (the stream lasts to the response's
# end so flow control can cut it: one more message per request).
_TRAILERS = "trailers"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds; medians reported")
    ap.add_argument("--sizes", default="1,100", help="request body sizes in KB")
    ap.add_argument("--conns", default="1,16", help="wrk connections")
    ap.add_argument(
        "--only",
        default="",
        help="comma list of configurations to run (envoy, floor FD, extproc FD, floor BUF, "
        "extproc BUF, sglang-router; floor BUF-noresp, floor llm-d, extproc llm-d and the "
        "response-header variants '<who> <FD|BUF>-skip|-send', the response-trailer one "
        "'<who> <FD|BUF>-trailers' only when named)",
    )
    ap.add_argument("--no-sglang", action="store_true")
    ap.add_argument(
        "--think-ms",
        type=float,
        default=0,
        help="pause per connection between requests: the same offered load for every "
        "configuration (default 0: closed loop, each runs as fast as it can)",
    )
    ap.add_argument(
        "--baseline-src",
        default="",
        help="a checkout of another extproc version: its picker runs next to this one, as "
        "'extproc-base FD' and 'extproc-base llm-d' (old vs new in one run)",
    )
    ap.add_argument("--big", action="store_true", help="220 KB prompts at 150 connections")
    args = ap.parse_args()
    if args.big:
        args.sizes, args.conns = "220", "150"
    require_wrk()
    sizes = [int(x) * 1024 for x in args.sizes.split(",")]
    conns_list = [int(x) for x in args.conns.split(",")]
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    procs: list[subprocess.Popen] = []
    results: dict[tuple[int, int, str], list[tuple[WrkResult, float]]] = {}
    with (
        tempfile.TemporaryDirectory() as tmp,
        Stack(StackOptions(upstreams=1)) as stack,
        contextlib.ExitStack() as cleanup,
    ):
        cleanup.callback(lambda: [(p.terminate(), p.wait()) for p in procs])
        work = Path(tmp)
        upstream = stack.upstream_addresses[0]
        targets: list[Target] = []

        def want(name: str) -> bool:
            return not only or name in only

        if want("envoy"):
            p, url = start_envoy(baseline_doc(upstream), work, "baseline")
            procs.append(p)
            targets.append(Target("envoy", url, None, p.pid))
        floor_port = free_port()
        floor = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("floor_processor.py")),
             str(floor_port), upstream],
        )  # fmt: skip
        procs.append(floor)
        picker_pid = stack._procs["extproc"].pid
        pickers = [("floor", floor_port, floor.pid), ("extproc", stack.extproc_port, picker_pid)]
        if args.baseline_src:
            base = start_baseline_picker(Path(args.baseline_src), upstream, work)
            procs.append(base[0])
            pickers.append(("extproc-base", base[1], base[0].pid))
        for mode, short in (("FULL_DUPLEX_STREAMED", "FD"), ("BUFFERED", "BUF")):
            for who, port, pid in pickers:
                name = f"{who} {short}"
                if want(name):
                    rh = _RESPONSE_HEADERS[who.split("-")[0]]
                    doc = picker_doc(port, mode, tls=True, response_headers=rh)
                    p, url = start_envoy(doc, work, name)
                    procs.append(p)
                    targets.append(Target(name, url, pid, p.pid))
                for variant in sorted(only):
                    m = _FLUSH.fullmatch(variant)
                    if m and (m[1], m[2]) == (who, short):
                        doc = picker_doc(
                            port, mode, tls=True, response_headers=_RESPONSE_HEADERS[who],
                            access_log_flush_s=int(m[3]) / 1000,
                        )  # fmt: skip
                        p, url = start_envoy(doc, work, variant)
                        procs.append(p)
                        targets.append(Target(variant, url, pid, p.pid))
                if f"{name}-{_TRAILERS}" in only:
                    doc = picker_doc(
                        port, mode, tls=True, response_headers=_RESPONSE_HEADERS[who],
                        response_trailers="send",
                    )  # fmt: skip
                    p, url = start_envoy(doc, work, f"{name}-{_TRAILERS}")
                    procs.append(p)
                    targets.append(Target(f"{name}-{_TRAILERS}", url, pid, p.pid))
                for suffix, rh in _VARIANTS.items():
                    variant = f"{name}-{suffix}"
                    if variant in only:
                        doc = picker_doc(port, mode, tls=True, response_headers=rh)
                        p, url = start_envoy(doc, work, variant)
                        procs.append(p)
                        targets.append(Target(variant, url, pid, p.pid))
        if only and "floor BUF-noresp" in only:
            # What skipping the response-header phase would save (4 messages, not 6).
            doc = picker_doc(floor_port, "BUFFERED", tls=True)
            hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
            for f in hcm["typed_config"]["http_filters"]:
                if f["name"] == "envoy.filters.http.ext_proc":
                    f["typed_config"]["processing_mode"]["response_header_mode"] = "SKIP"
            p, url = start_envoy(doc, work, "floor-noresp")
            procs.append(p)
            targets.append(Target("floor BUF-noresp", url, floor.pid, p.pid))
        for who, port, pid in pickers:
            name = f"{who} llm-d"
            if only and name in only:
                # llm-d's chart settings (extproc/gateways.py): FULL_DUPLEX both ways, the
                # response body echoed too, TLS, no access log: "behind a gateway".
                opts = BootstrapOptions(
                    listen_port=free_port(),
                    listen_address="127.0.0.1",
                    admin_port=free_port(),
                    extproc=f"127.0.0.1:{port}",
                    extproc_sni="localhost",
                    access_log=False,
                )
                p, url = start_envoy(gateway_bootstrap(LLM_D, opts), work, name)
                procs.append(p)
                targets.append(Target(name, url, pid, p.pid))
        if not args.no_sglang and want("sglang-router"):
            venv, version = install_sglang(work)
            if venv is None:
                print(version, file=sys.stderr)
            else:
                p, url = start_sglang(venv, upstream, work)
                procs.append(p)
                targets.append(Target(f"sglang-router {version}", url, p.pid))
        for size in sizes:
            body = work / f"body-{size}.json"
            body.write_bytes(chat_body(size))
            for conns in conns_list:
                for r in range(args.rounds):
                    for t in targets:
                        res, cpu, envoy_cpu = measure(
                            t.url, body, conns, args.seconds, t.pid, args.think_ms, t.envoy_pid
                        )
                        results.setdefault((size, conns, t.name), []).append((res, cpu, envoy_cpu))
                        print(
                            f"round {r} {size // 1024:>4} KB c={conns:<3} {t.name:<22} "
                            f"p50 {res.p50_ms:7.3f} p99 {res.p99_ms:7.3f} ms "
                            f"cpu {cpu:.3f} envoy {envoy_cpu:.3f} ms/req "
                            f"rps {res.rps:8.0f} non-2xx {res.non_2xx}",
                            flush=True,
                        )
    report(results, [t.name for t in targets], sizes, conns_list)


def report(results, names: list[str], sizes: list[int], conns_list: list[int]) -> None:
    def med(key, f):
        runs = results.get(key)
        return statistics.median(f(r) for r in runs) if runs else float("nan")

    print(
        "\n| body | conc | configuration | p50 ms | p99 ms | added p50 ms vs Envoy "
        "| CPU ms/req | CPU vs floor FD | CPU vs own-mode floor | Envoy CPU ms/req | req/s "
        "| non-2xx |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for size in sizes:
        for conns in conns_list:
            base = med((size, conns, "envoy"), lambda r: r[0].p50_ms)
            floor_fd = med((size, conns, "floor FD"), lambda r: r[1])
            for name in names:
                key = (size, conns, name)
                p50 = med(key, lambda r: r[0].p50_ms)
                cpu = med(key, lambda r: r[1])
                own = name.split()[-1]
                own_floor = med((size, conns, f"floor {own}"), lambda r: r[1])
                ref = own_floor if own == "llm-d" else floor_fd  # gateway vs its own floor
                ratio = f"{cpu / ref:.2f}x" if cpu and ref == ref else "-"
                own_ratio = (
                    f"{cpu / own_floor:.2f}x"
                    if name.startswith("extproc") and own_floor == own_floor
                    else "-"
                )
                print(
                    f"| {size // 1024} KB | {conns} | {name} | {p50:.3f} "
                    f"| {med(key, lambda r: r[0].p99_ms):.3f} | {p50 - base:+.3f} "
                    f"| {cpu:.3f} | {ratio} | {own_ratio} | {med(key, lambda r: r[2]):.3f} "
                    f"| {med(key, lambda r: r[0].rps):.0f} "
                    f"| {sum(r[0].non_2xx for r in results.get(key, []))} |"
                )


if __name__ == "__main__":
    main()
