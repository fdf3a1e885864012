"""Where the picker's CPU goes next to the floor's, natively: `perf record` on each process
under the same wrk load through its own Envoy (1 KB chat; the picker with
`--response-headers skip`, the floor processor keeping that phase, as in RESULTS.md),
interleaved round by round, and the samples split by shared object (the Python interpreter,
gRPC's core, upb, orjson, libc, the kernel...). Samples per request per object say which
layer the difference lives in; Python 3.11 has no perf trampolines, so Python functions
show as the interpreter (the in-process cProfile of `profile_stream.py` splits those).

    uv run python bench/profile_native.py [--seconds 8] [--rounds 2] [--conns 1]
"""

from __future__ import annotations

import argparse
import collections
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench_proxy import (
    chat_body,
    cpu_seconds,
    picker_doc,
    require_wrk,
    run_wrk,
    start_envoy,
)

from extproc.stack import Stack, StackOptions, free_port


def perf_by_dso(pid: int, seconds: float, out: Path, run) -> tuple[dict[str, int], object]:
    """Sample `pid` (all threads, 999 Hz) while `run()` drives load; samples per object."""
    rec = subprocess.Popen(
        ["perf", "record", "-F", "999", "-p", str(pid), "-o", str(out), "--", "sleep",
         str(seconds + 1)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    res = run()
    rec.wait()
    text = subprocess.run(
        ["perf", "report", "-i", str(out), "--stdio", "--sort", "dso", "-F", "sample,dso"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    counts: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0].isdigit():
            counts[parts[1]] = int(parts[0])
    return counts, res


def short(dso: str) -> str:
    if dso.startswith("[kernel"):
        return "kernel"
    name = Path(dso).name
    for key, label in (("cygrpc", "grpc core (cygrpc)"), ("_upb", "upb (protobuf)"),
                       ("orjson", "orjson"), ("python3", "python interpreter"),
                       ("libpython", "python interpreter"), ("libc.", "libc"),
                       ("libssl", "openssl"), ("libcrypto", "openssl"), ("uvloop", "uvloop"),
                       ("xxhash", "xxhash"), ("msgspec", "msgspec")):  # fmt: skip
        if key in name:
            return label
    return name


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conns", type=int, default=1)
    args = ap.parse_args()
    require_wrk()
    per_req: dict[str, dict[str, list[float]]] = {"extproc": {}, "floor": {}}
    cpu: dict[str, list[float]] = {"extproc": [], "floor": []}
    with tempfile.TemporaryDirectory() as tmp, Stack(StackOptions(upstreams=1)) as stack:
        work = Path(tmp)
        upstream = stack.upstream_addresses[0]
        floor_port = free_port()
        floor = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("floor_processor.py")),
             str(floor_port), upstream],
        )  # fmt: skip
        procs = [floor]
        try:
            targets = []
            for who, port, pid, rh in (
                ("extproc", stack.extproc_port, stack._procs["extproc"].pid, "skip"),
                ("floor", floor_port, floor.pid, "send"),
            ):
                doc = picker_doc(port, "FULL_DUPLEX_STREAMED", tls=True, response_headers=rh)
                p, url = start_envoy(doc, work, who)
                procs.append(p)
                targets.append((who, url, pid))
            body = work / "body.json"
            body.write_bytes(chat_body(1024))
            for r in range(args.rounds):
                for who, url, pid in targets:
                    run_wrk(url, body, args.conns, 1)
                    c0 = cpu_seconds(pid)
                    counts, res = perf_by_dso(
                        pid, args.seconds, work / f"{who}-{r}.data",
                        lambda url=url: run_wrk(url, body, args.conns, args.seconds),
                    )  # fmt: skip
                    cpu[who].append((cpu_seconds(pid) - c0) / res.requests * 1e3)
                    merged: dict[str, int] = collections.Counter()
                    for dso, n in counts.items():
                        merged[short(dso)] += n
                    for dso, n in merged.items():
                        per_req[who].setdefault(dso, []).append(n / res.requests)
                    print(f"round {r} {who}: {res.requests} requests, "
                          f"{sum(merged.values())} samples, cpu {cpu[who][-1]:.3f} ms/req",
                          flush=True)  # fmt: skip
        finally:
            for p in procs:
                p.terminate()
                p.wait()
    names = sorted(
        set(per_req["extproc"]) | set(per_req["floor"]),
        key=lambda d: -statistics.median(per_req["extproc"].get(d, [0.0])),
    )
    print("\n| shared object | extproc samples/req | floor samples/req | difference |")
    print("|---|---|---|---|")
    tot_e = tot_f = 0.0
    for d in names:
        e = statistics.median(per_req["extproc"].get(d, [0.0]))
        f = statistics.median(per_req["floor"].get(d, [0.0]))
        tot_e, tot_f = tot_e + e, tot_f + f
        if e >= 0.005 or f >= 0.005:
            print(f"| {d} | {e:.3f} | {f:.3f} | {e - f:+.3f} |")
    print(f"| total | {tot_e:.3f} | {tot_f:.3f} | {tot_e - tot_f:+.3f} |")
    print(f"\nCPU ms/req (from /proc): extproc {cpu['extproc']}, floor {cpu['floor']}")


if __name__ == "__main__":
    main()
