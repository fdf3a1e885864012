"""How picker throughput scales with `extproc serve --workers N` (1 vs 2 by default).

The picker runs with static loopback endpoints (never contacted: scraping off, memory index)
and each worker count is driven for a fixed time by a gRPC load generator in separate
processes (`--clients` processes x `--channels` connections x `--streams` concurrent
ext_proc streams each). Every stream is one full request the way Envoy sends it in
FULL_DUPLEX_STREAMED mode: headers, a ~1 KB chat body, end of stream; the picker answers
with the decision and the echoed body. Each channel is its own TCP connection, because
SO_REUSEPORT spreads connections (not streams) across the workers.

    uv run python bench/bench_workers.py [--seconds 10] [--workers 1,2]

The load generator shares the machine with the picker: on a small machine the figures say
how much of the CPU the picker can turn into decisions, not its ceiling on a dedicated host.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
import orjson
import yaml
from grpc_health.v1 import health_pb2

from extproc import protocol
from extproc.stack import free_port, grpc_health_status, wait_until
from extproc.testing import body_chunks, destination, pb, post, request_headers

ENDPOINTS = ",".join(f"127.0.0.{i}:8000" for i in range(11, 19))
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


def chat_body() -> bytes:
    text = ("The quick brown fox jumps over the lazy dog. " * 22)[:950]
    return orjson.dumps({"model": "m", "messages": [{"role": "user", "content": text}]})


async def _client(port: int, channels: int, streams: int, warmup_s: float, seconds: float):
    messages = [request_headers(post("/v1/chat/completions")), *body_chunks(chat_body())]
    # A local subchannel pool per channel: otherwise grpc shares one TCP connection among
    # channels with the same target, and every stream would land on one worker.
    chans = [
        grpc.aio.insecure_channel(
            f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)]
        )
        for _ in range(channels)
    ]
    calls = [
        ch.stream_stream(
            protocol.EXT_PROC_METHOD,
            request_serializer=pb.ProcessingRequest.SerializeToString,
            response_deserializer=pb.ProcessingResponse.FromString,
        )
        for ch in chans
    ]
    loop = asyncio.get_running_loop()
    start = loop.time()
    measure_from, stop_at = start + warmup_s, start + warmup_s + seconds
    done = errors = 0

    async def worker(i: int) -> None:
        nonlocal done, errors
        method = calls[i % len(calls)]
        while (now := loop.time()) < stop_at:
            try:
                call = method()
                for m in messages:
                    await call.write(m)
                await call.done_writing()
                responses = [r async for r in call]  # read to the end: the stream closes
                ok = bool(responses) and destination(responses[0]) is not None
            except grpc.aio.AioRpcError:
                ok = False
            if now >= measure_from:
                if ok:
                    done += 1
                else:
                    errors += 1

    await asyncio.gather(*(worker(i) for i in range(channels * streams)))
    for ch in chans:
        await ch.close()
    return done, errors


def _client_main(port, channels, streams, warmup_s, seconds, out):
    out.put(asyncio.run(_client(port, channels, streams, warmup_s, seconds)))


def _cpu_s(pids: list[int]) -> float:
    total = 0.0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) * TICK_S  # utime + stime
    return total


def _tree(pid: int) -> list[int]:
    out = [pid]
    for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split():
        out.extend(_tree(int(child)))
    return out


def run(workers: int, args: argparse.Namespace) -> dict:
    port, health = free_port(), free_port()
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "picker.yaml"
        config.write_text(yaml.safe_dump({"state": {"scrape": None}}))
        argv = [
            *(sys.executable, "-m", "extproc", "--log-level", "WARNING", "serve", "--plaintext"),
            *("--config", str(config), "--endpoints", ENDPOINTS, "--host", "127.0.0.1"),
            *("--port", str(port), "--health-port", str(health), "--admin-port", "0"),
        ]
        if workers > 1:
            argv += ["--workers", str(workers)]
        proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            wait_until(
                lambda: (
                    grpc_health_status(health, "readiness")
                    == health_pb2.HealthCheckResponse.SERVING
                ),
                timeout_s=30,
                what="extproc",
                proc=proc,
            )
            time.sleep(1.0 if workers > 1 else 0.2)  # every worker up, not just the first
            ctx = mp.get_context("spawn")
            out = ctx.Queue()
            clients = [
                ctx.Process(
                    target=_client_main,
                    args=(port, args.channels, args.streams, args.warmup, args.seconds, out),
                )
                for _ in range(args.clients)
            ]
            for c in clients:
                c.start()
            time.sleep(args.warmup)
            cpu0 = _cpu_s(_tree(proc.pid))
            time.sleep(args.seconds)
            cpu1 = _cpu_s(_tree(proc.pid))
            results = [out.get(timeout=60) for _ in clients]
            for c in clients:
                c.join()
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    done = sum(r[0] for r in results)
    errors = sum(r[1] for r in results)
    return {
        "workers": workers,
        "rps": done / args.seconds,
        "errors": errors,
        "picker_cpu_ms_per_req": 1000 * (cpu1 - cpu0) / max(done, 1),
        "picker_cores": (cpu1 - cpu0) / args.seconds,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", default="1,2", help="comma list of worker counts")
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--warmup", type=float, default=2.0)
    p.add_argument("--clients", type=int, default=2, help="load-generator processes")
    p.add_argument("--channels", type=int, default=4, help="connections per client process")
    p.add_argument("--streams", type=int, default=8, help="concurrent streams per connection")
    args = p.parse_args()
    print(
        f"cpus={os.cpu_count()} clients={args.clients} x channels={args.channels} x "
        f"streams={args.streams}, {args.seconds:g}s after {args.warmup:g}s warm-up"
    )
    rows = [run(int(w), args) for w in args.workers.split(",")]
    print(f"{'workers':>7} {'req/s':>8} {'errors':>6} {'cpu ms/req':>10} {'picker cores':>12}")
    for r in rows:
        print(
            f"{r['workers']:>7} {r['rps']:>8.0f} {r['errors']:>6} "
            f"{r['picker_cpu_ms_per_req']:>10.3f} {r['picker_cores']:>12.2f}"
        )
    base = rows[0]["rps"]
    for r in rows[1:]:
        print(f"ratio {r['workers']}w/{rows[0]['workers']}w: {r['rps'] / base:.2f}")


if __name__ == "__main__":
    main()
