"""Issue 17's transport spike: the floor processor (`floor_processor.py`, the least an ext_proc
picker can do) on several gRPC servers and settings, each behind its own Envoy with the same
bootstrap (`extproc envoy-config`'s: TLS to the processor, the access-log stream, the
response-header phase kept), in the FULL_DUPLEX_STREAMED and BUFFERED exchanges, round by round
interleaved (A, B, C, A, B, C), CPU per request of the floor process from /proc and p50 added
over Envoy alone (medians over rounds, and every round printed).

    uv run python bench/bench_transport.py [--seconds 4] [--rounds 3] [--conns 1,16]
        [--only "aio,sync,..."] [--modes FD,BUF] [--picker] [--pyvoy-path DIR]
    # pyvoy is not a project dependency:  uv pip install --target DIR pyvoy==1.3.0

`--picker` adds `extproc serve` (the stack's picker) in FULL_DUPLEX, as a ratio to each floor,
and each variant's p50 minus the picker's in the same round (median over rounds). The
`picker-pyvoy-*` variants run `picker_pyvoy.py` with its knobs (no grpc.aio server, Envoy
concurrency 2, per-stream timings, coalesced replies, GIL switch interval).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from bench_proxy import (
    baseline_doc,
    chat_body,
    cpu_seconds,
    picker_doc,
    require_wrk,
    run_wrk,
    start_envoy,
)

from extproc.stack import Stack, StackOptions, free_port, wait_until


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...] = ()
    env: dict[str, str] = field(default_factory=dict)
    tls: bool = True  # False: plaintext both ways (what TLS itself costs the floor)


VARIANTS = (
    Variant("aio"),  # the reference floor: grpc.aio under uvloop, defaults
    Variant("aio-asyncio", ("--loop=asyncio",)),
    Variant("aio-poll", env={"GRPC_POLL_STRATEGY": "poll"}),
    Variant("aio-nofork", env={"GRPC_ENABLE_FORK_SUPPORT": "0"}),
    Variant(
        "aio-opts",
        (
            "--option=grpc.so_reuseport=0",
            "--option=grpc.http2.bdp_probe=0",
            "--option=grpc.max_concurrent_streams=1000",
            "--option=grpc.optimization_target=throughput",
        ),
    ),
    Variant("sync", ("--transport=sync", "--threads=64")),
    Variant("grpclib", ("--transport=grpclib",)),
    Variant("aio-plain", ("--plaintext",), tls=False),
    # pyvoy (Envoy hosting the interpreter, ASGI): needs --pyvoy-path.
    Variant("pyvoy", ("--transport=pyvoy",)),
    Variant("pyvoy-c1", ("--transport=pyvoy", "--envoy-concurrency=1")),
    # Not a floor: the picker's real handlers on pyvoy (bench/picker_pyvoy.py).
    Variant(
        "picker-pyvoy-c1", ("--transport=pyvoy", "--envoy-concurrency=1", "--app=picker_pyvoy:app")
    ),
    # The same with no grpc.aio server in the process (health only, or none at all).
    Variant(
        "picker-pyvoy-health",
        ("--transport=pyvoy", "--envoy-concurrency=1", "--app=picker_pyvoy:app"),
        env={"PICKER_GRPC": "health"},
    ),
    Variant(
        "picker-pyvoy-nogrpc",
        ("--transport=pyvoy", "--envoy-concurrency=1", "--app=picker_pyvoy:app"),
        env={"PICKER_GRPC": ""},
    ),
    Variant(
        "picker-pyvoy-switch",
        ("--transport=pyvoy", "--envoy-concurrency=1", "--app=picker_pyvoy:app"),
        env={"PICKER_GRPC": "", "PICKER_SWITCH_S": "0.0002"},
    ),
    Variant(
        "picker-pyvoy-trace",
        ("--transport=pyvoy", "--envoy-concurrency=1", "--app=picker_pyvoy:app"),
        env={"PICKER_GRPC": "", "PICKER_TRACE": "/tmp/picker-pyvoy-trace.txt"},
    ),
    Variant(
        "picker-pyvoy-c2",
        ("--transport=pyvoy", "--envoy-concurrency=2", "--app=picker_pyvoy:app"),
        env={"PICKER_GRPC": ""},
    ),
    Variant(
        "picker-pyvoy-coalesce",
        ("--transport=pyvoy", "--envoy-concurrency=1", "--app=picker_pyvoy:app"),
        env={"PICKER_GRPC": "", "PICKER_COALESCE": "1", "PICKER_TRACE": "/tmp/picker-pyvoy-co.txt"},
    ),
)


def tree_cpu_seconds(pid: int) -> float:
    """utime + stime of `pid` and every descendant (pyvoy's Envoy is a child of its CLI)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, todo = {pid}, [pid]
    while todo:
        parent = todo.pop()
        for child, ppid in parents.items():
            if ppid == parent and child not in tree:
                tree.add(child)
                todo.append(child)
    total = 0.0
    for p in tree:
        with contextlib.suppress(OSError):  # gone meanwhile
            total += cpu_seconds(p)
    return total


def measure_tree(
    url: str, body: Path, conns: int, seconds: int, pid: int | None, think_ms: float = 0
):
    run_wrk(url, body, conns, 1, think_ms)  # warm up connections and caches
    cpu0 = tree_cpu_seconds(pid) if pid else 0.0
    res = run_wrk(url, body, conns, seconds, think_ms)
    cpu_ms = (tree_cpu_seconds(pid) - cpu0) / max(res.requests, 1) * 1e3 if pid else 0.0
    return res, cpu_ms


def cap_streams(doc: dict, per_connection: int) -> dict:
    """`max_requests_per_connection` on the picker's cluster: Envoy replaces each connection
    after that many streams (pyvoy 1.3.0 fails past ~1,050 reset streams on one)."""
    for cluster in doc["static_resources"]["clusters"]:
        if cluster["name"] == "extproc":
            opts = cluster["typed_extension_protocol_options"][
                "envoy.extensions.upstreams.http.v3.HttpProtocolOptions"
            ]
            opts["common_http_protocol_options"] = {"max_requests_per_connection": per_connection}
    return doc


def start_floor(
    variant: Variant, upstream: str, work: Path, pyvoy_path: str
) -> tuple[subprocess.Popen, int]:
    port = free_port()
    env = {**os.environ, **variant.env}
    if "pyvoy" in variant.name:
        env["PYTHONPATH"] = pyvoy_path
    log = open(work / f"floor-{variant.name}.log", "ab")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, str(Path(__file__).with_name("floor_processor.py")), str(port), upstream,
         *variant.flags],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        env=env,
    )  # fmt: skip
    log.close()
    return proc, port


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--conns", default="1,16")
    ap.add_argument("--size-kb", type=int, default=1)
    ap.add_argument("--modes", default="FD,BUF")
    ap.add_argument("--only", default="", help="comma list of variant names")
    ap.add_argument(
        "--pyvoy-path",
        default="",
        help="a `pip install --target DIR pyvoy` directory; without it the pyvoy floor is skipped",
    )
    ap.add_argument(
        "--think-ms", type=float, default=0, help="pause per connection: equal offered load"
    )
    ap.add_argument(
        "--max-streams-per-connection",
        type=int,
        default=0,
        help="Envoy's max_requests_per_connection on the processor cluster (0: unlimited)",
    )
    ap.add_argument("--workdir", default="", help="keep the processes' logs here")
    ap.add_argument("--picker", action="store_true", help="the picker too (FD only)")
    args = ap.parse_args()
    require_wrk()
    only = {x.strip() for x in args.only.split(",") if x.strip()}
    variants = [
        v
        for v in VARIANTS
        if (not only or v.name in only) and ("pyvoy" not in v.name or args.pyvoy_path)
    ]
    modes = {"FD": "FULL_DUPLEX_STREAMED", "BUF": "BUFFERED"}
    procs: list[subprocess.Popen] = []
    results: dict[tuple[int, str], list[tuple[float, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp, Stack(StackOptions(upstreams=1)) as stack:
        work = Path(args.workdir or tmp)
        work.mkdir(parents=True, exist_ok=True)
        try:
            upstream = stack.upstream_addresses[0]
            p, envoy_url = start_envoy(baseline_doc(upstream), work, "baseline")
            procs.append(p)
            targets: list[tuple[str, str, int | None]] = [("envoy", envoy_url, None)]
            for v in variants:
                floor, port = start_floor(v, upstream, work, args.pyvoy_path)
                procs.append(floor)
                for short in args.modes.split(","):
                    doc = picker_doc(port, modes[short], tls=v.tls, response_headers="send")
                    if args.max_streams_per_connection:
                        cap_streams(doc, args.max_streams_per_connection)
                    p, url = start_envoy(doc, work, f"{v.name}-{short}")
                    procs.append(p)
                    targets.append((f"{v.name} {short}", url, floor.pid))
            if args.picker:
                doc = picker_doc(stack.extproc_port, modes["FD"], tls=True, response_headers="send")
                if args.max_streams_per_connection:
                    cap_streams(doc, args.max_streams_per_connection)
                p, url = start_envoy(doc, work, "extproc-FD")
                procs.append(p)
                targets.append(("extproc FD", url, stack._procs["extproc"].pid))
            body = work / "body.json"
            body.write_bytes(chat_body(args.size_kb * 1024))
            # The floors serve health like the picker; wait for Envoy to see them healthy.
            for _, url, _pid in targets[1:]:
                wait_until(lambda u=url: _ok(u, body), timeout_s=90, what=url)
            for conns in (int(c) for c in args.conns.split(",")):
                for r in range(args.rounds):
                    for name, url, pid in targets:
                        res, cpu = measure_tree(url, body, conns, args.seconds, pid, args.think_ms)
                        results.setdefault((conns, name), []).append((res.p50_ms, cpu))
                        print(
                            f"round {r} c={conns:<3} {name:<16} p50 {res.p50_ms:7.3f} ms "
                            f"cpu {cpu:.3f} ms/req rps {res.rps:7.0f} non-2xx {res.non_2xx}",
                            flush=True,
                        )
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    report(results, [t[0] for t in targets], [int(c) for c in args.conns.split(",")])


def _ok(url: str, body: Path) -> bool:
    import httpx

    return httpx.post(f"{url}/v1/chat/completions", content=body.read_bytes()).status_code == 200


def report(results, names: list[str], conns_list: list[int]) -> None:
    print("\n| conc | configuration | p50 ms | added p50 ms | CPU ms/req (rounds) | median "
          "| vs aio floor, same mode | p50 vs picker on grpc.aio, per round |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for conns in conns_list:
        base = statistics.median(r[0] for r in results[(conns, "envoy")])
        for name in names:
            runs = results[(conns, name)]
            p50 = statistics.median(r[0] for r in runs)
            cpus = [r[1] for r in runs]
            cpu = statistics.median(cpus)
            mode = name.split()[-1]
            ref = results.get((conns, f"aio {mode}"))
            ratio = "-"
            if ref and name != "envoy":
                # Ratio per round, then the median: load swings hit a round's A and B alike.
                per_round = [c / a[1] for c, a in zip(cpus, ref, strict=True)]
                ratio = f"{statistics.median(per_round):.2f}x"
            picker = results.get((conns, "extproc FD"))
            gap = "-"
            if picker and name not in ("envoy", "extproc FD"):
                # p50 minus the grpc.aio picker's in the same round (adjacent in time): the
                # machine's load swings move both, the difference less.
                diffs = [r[0] - a[0] for r, a in zip(runs, picker, strict=True)]
                gap = f"{statistics.median(diffs):+.2f}"
            print(
                f"| {conns} | {name} | {p50:.3f} | {p50 - base:+.3f} "
                f"| {' '.join(f'{c:.3f}' for c in cpus)} | {cpu:.3f} | {ratio} | {gap} |"
            )


if __name__ == "__main__":
    main()
