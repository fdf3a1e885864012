"""Picker CPU per large request (400 KB, 4 MB chat bodies, every one a new prompt), against
the floor processor on the same Envoy bootstrap, interleaved round by round in one run.

Each request carries a unique first line, so its whole chain of block keys is new: the
picker parses, hashes, looks up and writes the full chain into its index (the case where the
index write used to dominate). CPU is the on-CPU time of the picker's threads (and of the
floor's) from /proc/<pid>/task/*/schedstat, divided by the requests of the round; the figure
quoted is the median of the rounds and its ratio to the floor's median. Both speak plaintext
gRPC to Envoy.

    uv run python bench/bench_bodies.py [--rounds 5] [--per-round 8]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from bench_parse import chat_body
from bench_proxy import bootstrap, start_envoy

from extproc.stack import Stack, StackOptions, free_port, wait_until


def unique(base: bytes, n: int) -> bytes:
    """`base` with a unique first line in its first message: a new chain from block 0."""
    return base.replace(b'"content":"', b'"content":"req %09d ' % n, 1)


def cpu_seconds(pid: int) -> float:
    """On-CPU time of every live thread of `pid`, in nanoseconds from schedstat (the
    10 ms ticks of /proc/<pid>/stat are too coarse for a few requests)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):  # thread ended
            total += int((task / "schedstat").read_text().split()[0])
    return total / 1e9


def round_cpu_ms(client: httpx.Client, url: str, pid: int, bodies: list[bytes]) -> float:
    start = cpu_seconds(pid)
    for body in bodies:
        r = client.post(
            f"{url}/v1/chat/completions",
            content=body,
            headers={"content-type": "application/json"},
        )
        if r.status_code != 200:
            raise SystemExit(f"{url}: HTTP {r.status_code}: {r.text[:200]}")
    return (cpu_seconds(pid) - start) / len(bodies) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--per-round", type=int, default=8)
    ap.add_argument("--sizes", default="400,4096", help="body sizes in KB")
    args = ap.parse_args()
    counter = 0
    opts = StackOptions(upstreams=1, plaintext=True)
    with tempfile.TemporaryDirectory() as tmp, Stack(opts) as stack:
        upstream = stack.upstream_addresses[0]
        floor_port = free_port()
        floor = subprocess.Popen(
            [sys.executable, str(Path(__file__).with_name("floor_processor.py")),
             str(floor_port), upstream, "--plaintext"]
        )  # fmt: skip
        floor_env, floor_url = start_envoy(
            bootstrap(extproc=f"127.0.0.1:{floor_port}", extproc_tls=False), Path(tmp), "floor"
        )
        picker = stack._procs["extproc"].pid
        # Envoy health-checks the floor: wait until it routes there.
        probe = chat_body(1024)
        wait_until(
            lambda: (
                httpx.post(f"{floor_url}/v1/chat/completions", content=probe).status_code == 200
            ),
            timeout_s=30,
            what="the floor processor behind Envoy",
        )
        try:
            with httpx.Client(timeout=60) as client:
                for kb in (int(s) for s in args.sizes.split(",")):
                    base = chat_body(kb * 1024)
                    floor_ms: list[float] = []
                    picker_ms: list[float] = []
                    warm = [unique(base, counter + i) for i in range(2)]
                    counter += 2
                    round_cpu_ms(client, floor_url, floor.pid, warm)
                    round_cpu_ms(client, stack.url, picker, warm)
                    for _ in range(args.rounds):
                        bodies = [unique(base, counter + i) for i in range(args.per_round)]
                        counter += args.per_round
                        floor_ms.append(round_cpu_ms(client, floor_url, floor.pid, bodies))
                        picker_ms.append(round_cpu_ms(client, stack.url, picker, bodies))
                    f, p = statistics.median(floor_ms), statistics.median(picker_ms)
                    print(
                        f"| {kb} KB | {p:.2f} (rounds {min(picker_ms):.2f}-{max(picker_ms):.2f}) "
                        f"| {f:.2f} (rounds {min(floor_ms):.2f}-{max(floor_ms):.2f}) "
                        f"| {p / f:.2f}x |",
                        flush=True,
                    )
        finally:
            for p in (floor_env, floor):
                p.terminate()
                p.wait()


if __name__ == "__main__":
    main()
