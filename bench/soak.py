"""Soak: real Envoy + extproc (Redis index) + simulated vLLM servers, a steady open-loop rate
for `--minutes`, then a burst phase; the picker must cause no errors, keep its memory flat,
return its in-flight counters to zero and keep the index within its capacity.

    uv run python bench/soak.py                 # 10 min steady + 60 s burst
    uv run python bench/soak.py --quick         # 45 s steady + 15 s burst
    uv run python bench/soak.py --json out.json # also write the figures

Every response is classified: 200; an upstream error (the simulated server answered, its
`x-served-by` header is present, or Envoy reports an upstream failure: reset, connect
failure, 503 no healthy upstream); a picker rejection (the picker's own OpenAI-style JSON
error, a 4xx it chose); or a picker-caused error (any other non-200: ext_proc stream
failure, picker 5xx). The workload is valid, so the last two must be zero. Exit status 1
when any check fails.

Workload: `--groups` shared system prompts, multi-turn conversations that grow turn by turn
(affinity matters), plus a share of one-off prompts that only grow the index, so capacity
eviction is exercised; the picker runs with `index.capacity_blocks` = `--capacity`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import psutil
import redis
import yaml

from extproc.stack import Stack, StackOptions, free_port, wait_until

WORDS = [
    "alpha",
    "bravo",
    "charlie",
    "delta",
    "echo",
    "foxtrot",
    "golf",
    "hotel",
    "india",
    "juliet",
    "kilo",
    "lima",
    "mike",
    "november",
    "oscar",
    "papa",
    "quebec",
    "romeo",
    "sierra",
    "tango",
    "uniform",
    "victor",
    "whiskey",
    "xray",
    "yankee",
    "zulu",
]


@dataclass
class Tally:
    sent: int = 0
    ok: int = 0
    upstream_errors: int = 0
    picker_rejections: int = 0
    picker_errors: int = 0
    client_errors: int = 0  # the client itself timed out or lost the connection
    by_endpoint: dict[str, int] = field(default_factory=dict)
    samples: list[str] = field(default_factory=list)  # first few non-200 answers, for the log
    error_times_s: list[float] = field(default_factory=list)  # when each non-200 was sent
    latencies_s: list[float] = field(default_factory=list)


class Workload:
    """Seeded bodies: conversations over shared system prompts, and one-off prompts."""

    def __init__(self, groups: int, oneoff_share: float, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.systems = [
            f"[group {g}] " + " ".join(self.rng.choice(WORDS) for _ in range(150))
            for g in range(groups)
        ]
        self.turns: dict[int, int] = {}  # conversation -> next turn
        self.oneoff_share = oneoff_share
        self.next_conv = 0

    def body(self) -> bytes:
        rng = self.rng
        if rng.random() < self.oneoff_share:
            text = f"one-off {rng.random()} " + " ".join(rng.choice(WORDS) for _ in range(120))
            messages = [{"role": "user", "content": text}]
        else:
            # Revisit a live conversation most of the time; start a new one otherwise, and
            # retire conversations after 8 turns so prompts stay bounded.
            live = [c for c, t in self.turns.items() if t < 8]
            if live and rng.random() < 0.8:
                conv = rng.choice(live)
            else:
                conv = self.next_conv
                self.next_conv += 1
                self.turns[conv] = 0
                if len(self.turns) > 400:
                    self.turns.pop(min(self.turns))
            turn = self.turns[conv]
            self.turns[conv] = turn + 1
            messages = [{"role": "system", "content": self.systems[conv % len(self.systems)]}]
            for t in range(turn):
                messages.append({"role": "user", "content": f"conv {conv} question {t}"})
                messages.append({"role": "assistant", "content": f"answer {t} " * 8})
            messages.append({"role": "user", "content": f"conv {conv} question {turn}"})
        return json.dumps({"model": "tiny", "messages": messages, "max_tokens": 8}).encode()


def classify(status: int, headers, body: bytes, tally: Tally) -> None:
    if status == 200:
        tally.ok += 1
        served = headers.get("x-served-by", "?")
        tally.by_endpoint[served] = tally.by_endpoint.get(served, 0) + 1
        return
    if len(tally.samples) < 5:
        tally.samples.append(f"{status} {dict(headers)} {body[:200]!r}")
    if "x-served-by" in headers or headers.get("x-envoy-upstream-service-time") is not None:
        tally.upstream_errors += 1
        return
    text = body.decode(errors="replace")
    if status in (502, 503, 504) and (
        "upstream connect error" in text or "no healthy upstream" in text or "reset" in text
    ):
        tally.upstream_errors += 1
        return
    try:
        err = json.loads(body)["error"]
        picker_json = isinstance(err, dict) and "code" in err
    except (ValueError, KeyError, TypeError):
        picker_json = False
    if picker_json and 400 <= status < 500:
        tally.picker_rejections += 1
    else:
        tally.picker_errors += 1


async def drive(
    url: str, wl: Workload, rate: float, seconds: float, tally: Tally, t_start: float
) -> None:
    """Open loop: Poisson arrivals at `rate`/s for `seconds`; waits for the stragglers."""
    timeout = aiohttp.ClientTimeout(total=60)
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(timeout=timeout, connector=conn) as http:

        async def one(body: bytes) -> None:
            start = time.perf_counter()
            sent_at = time.monotonic() - t_start
            try:
                async with http.post(
                    f"{url}/v1/chat/completions",
                    data=body,
                    headers={"content-type": "application/json"},
                ) as r:
                    data = await r.read()
                    classify(r.status, r.headers, data, tally)
                    if r.status != 200:
                        tally.error_times_s.append(round(sent_at, 1))
            except (aiohttp.ClientError, TimeoutError) as exc:
                tally.client_errors += 1
                tally.error_times_s.append(round(sent_at, 1))
                if len(tally.samples) < 5:
                    tally.samples.append(f"client: {exc!r}")
                return
            tally.latencies_s.append(time.perf_counter() - start)

        tasks: set[asyncio.Task] = set()
        rng = random.Random(11)
        t0 = time.monotonic()
        next_at = t0
        while next_at - t0 < seconds:
            await asyncio.sleep(max(0.0, next_at - time.monotonic()))
            tally.sent += 1
            task = asyncio.create_task(one(wl.body()))
            tasks.add(task)
            task.add_done_callback(tasks.discard)
            next_at += rng.expovariate(rate)
        if tasks:
            await asyncio.gather(*tasks)


async def sample_rss(
    pid: int, every_s: float, out: list[tuple[float, int, float]], stop: asyncio.Event
):
    """(seconds, picker RSS bytes, 1-min load average of the machine) every `every_s`."""
    proc = psutil.Process(pid)
    t0 = time.monotonic()
    while not stop.is_set():
        out.append((time.monotonic() - t0, proc.memory_info().rss, os.getloadavg()[0]))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), every_s)


def prom_values(text: str, name: str) -> list[float]:
    """Every sample of metric `name` (any labels) in a Prometheus exposition."""
    out = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name) : len(name) + 1] in ("{", " "):
            out.append(float(line.rsplit(" ", 1)[1]))
    return out


def histogram_quantile(text: str, name: str, q: float) -> float | None:
    """Upper bucket bound reaching quantile `q` of histogram `name` (Prometheus-style)."""
    buckets = []
    for line in text.splitlines():
        if line.startswith(f"{name}_bucket{{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            buckets.append((float(le), float(line.rsplit(" ", 1)[1])))
    if not buckets or buckets[-1][1] == 0:
        return None
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= q * total:
            return le
    return None


def start_redis(workdir: Path) -> tuple[subprocess.Popen, int]:
    binary = shutil.which("redis-server")
    if binary is None:
        sys.exit("redis-server not found")
    port = free_port()
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--dir", str(workdir)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    client = redis.Redis(port=port)
    wait_until(client.ping, timeout_s=10, what="redis", proc=proc)
    return proc, port


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--minutes", type=float, default=10.0, help="steady phase (default 10)")
    ap.add_argument("--rate", type=float, default=12.0, help="steady requests/s (default 12)")
    ap.add_argument("--burst-s", type=float, default=60.0, help="burst phase seconds (60)")
    ap.add_argument("--burst-rate", type=float, default=48.0, help="burst requests/s (48)")
    ap.add_argument("--servers", type=int, default=3)
    ap.add_argument("--groups", type=int, default=12)
    ap.add_argument("--capacity", type=int, default=2000, help="index.capacity_blocks")
    ap.add_argument("--quick", action="store_true", help="45 s steady + 15 s burst")
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args()
    if args.quick:
        args.minutes, args.burst_s = 0.75, 15.0
    with tempfile.TemporaryDirectory(prefix="soak-") as tmp:
        redis_proc, redis_port = start_redis(Path(tmp))
        try:
            return asyncio.run(soak(args, Path(tmp), redis_port))
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)


async def soak(args, tmp: Path, redis_port: int) -> int:
    cfg = tmp / "picker.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                # One fallback: override-host walks it when the first pick refuses connections.
                "server": {"fallbacks": 1},
                "index": {"capacity_blocks": args.capacity},
            }
        )
    )
    redis_url = f"redis://127.0.0.1:{redis_port}"
    opts = StackOptions(
        upstreams=args.servers,
        lb="override-host",
        sim_args=("--fast", "20", "--chat-max-tokens", "8"),
        extproc_args=("--redis-url", redis_url, "--config", str(cfg), "--log-level", "WARNING"),
    )
    with Stack(opts) as stack:
        pid = stack._procs["extproc"].pid
        admin = f"http://127.0.0.1:{stack.picker_admin_port}"
        rss: list[tuple[float, int, float]] = []
        stop = asyncio.Event()
        sampler = asyncio.create_task(sample_rss(pid, 5.0, rss, stop))
        wl = Workload(args.groups, oneoff_share=0.25)
        steady, burst = Tally(), Tally()
        t0 = time.monotonic()
        print(f"steady: {args.rate}/s for {args.minutes} min", flush=True)
        await drive(stack.url, wl, args.rate, args.minutes * 60, steady, t0)
        print(f"burst: {args.burst_rate}/s for {args.burst_s} s", flush=True)
        await drive(stack.url, wl, args.burst_rate, args.burst_s, burst, t0)
        elapsed = time.monotonic() - t0
        await asyncio.sleep(2.0)  # streams close right after response headers; margin
        stop.set()
        await sampler
        async with aiohttp.ClientSession() as http, http.get(f"{admin}/metrics") as r:
            metrics = await r.text()
        envoy = stack.envoy_stats("")
        r = redis.Redis(port=redis_port)
        index_sizes = {
            key.decode(): r.zcard(key) for key in r.scan_iter(match="extproc:kv:e:*", count=1000)
        }
        block_hashes = sum(1 for _ in r.scan_iter(match="extproc:kv:b:*", count=1000))
        figures = report(args, steady, burst, elapsed, rss, metrics, envoy, index_sizes)
        figures["index_chain_hashes"] = block_hashes
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2))
        ok = check(figures, args)
        if not ok:
            print(stack.logs("extproc")[-3000:])
        return 0 if ok else 1


def report(args, steady, burst, elapsed, rss, metrics, envoy, index_sizes) -> dict:
    def phase(t: Tally) -> dict:
        lat = sorted(t.latencies_s)
        d = asdict(t)
        d.pop("latencies_s")
        per_min: dict[int, int] = {}
        for e in d.pop("error_times_s"):
            per_min[int(e // 60)] = per_min.get(int(e // 60), 0) + 1
        d["errors_by_minute"] = per_min
        if lat:
            d["p50_s"] = round(lat[len(lat) // 2], 4)
            d["p99_s"] = round(lat[min(len(lat) - 1, int(len(lat) * 0.99))], 4)
        return d

    # Memory: the first minute is warm-up (imports, caches, pools growing to the working set);
    # growth is the last minute's median over the median of the minute after warm-up.
    mib = [(t, b / 2**20) for t, b, _ in rss]
    warm = [m for t, m in mib if 60 <= t < 120] or [m for _, m in mib[: max(1, len(mib) // 4)]]
    last = [m for t, m in mib if t >= mib[-1][0] - 60]
    figures = {
        "elapsed_s": round(elapsed, 1),
        "steady": phase(steady),
        "burst": phase(burst),
        "rss_mib_start": round(mib[0][1], 1),
        "rss_mib_after_warmup": round(statistics.median(warm), 1),
        "rss_mib_end": round(statistics.median(last), 1),
        "rss_mib_max": round(max(m for _, m in mib), 1),
        "rss_growth_mib": round(statistics.median(last) - statistics.median(warm), 1),
        "rss_samples": len(mib),
        "inflight_requests_end": prom_values(metrics, "extproc_inflight_requests"),
        "inflight_tokens_end": prom_values(metrics, "extproc_inflight_tokens"),
        "decisions": prom_values(metrics, "extproc_decisions_total"),
        "picker_error_outcomes": sum(
            float(line.rsplit(" ", 1)[1])
            for line in metrics.splitlines()
            if line.startswith("extproc_requests_total{") and 'outcome="error"' in line
        ),
        "lookups_degraded": prom_values(metrics, "extproc_index_lookups_degraded_total"),
        "index_writes_dropped": prom_values(metrics, "extproc_index_writes_dropped_total"),
        "decision_p99_s": histogram_quantile(metrics, "extproc_decision_seconds", 0.99),
        "decision_p50_s": histogram_quantile(metrics, "extproc_decision_seconds", 0.5),
        "index_capacity_blocks": args.capacity,
        "index_blocks_per_endpoint": index_sizes,
        "envoy_ext_proc": {k: v for k, v in envoy.items() if ".ext_proc." in k and v},
        "envoy_upstream_5xx": envoy.get("cluster.model_servers.upstream_rq_5xx", 0),
        "envoy_upstream_retries": envoy.get("cluster.model_servers.upstream_rq_retry", 0),
        "load_avg_max": max(la for _, _, la in rss),
        "rss_series_mib": [(round(t), round(m, 1)) for t, m in mib],
        "load_avg_series": [(round(t), la) for t, _, la in rss],
    }
    series = ("rss_series_mib", "load_avg_series")
    print(json.dumps({k: v for k, v in figures.items() if k not in series}, indent=2))
    return figures


def check(f: dict, args) -> bool:
    problems = []
    for name in ("steady", "burst"):
        p = f[name]
        if p["picker_errors"] or p["picker_rejections"]:
            problems.append(f"{name}: picker-caused errors {p['picker_errors']}")
        if p["ok"] == 0:
            problems.append(f"{name}: nothing served")
    if f["picker_error_outcomes"]:
        problems.append(f"picker counted {f['picker_error_outcomes']} error outcomes")
    if any(f["inflight_requests_end"]) or any(f["inflight_tokens_end"]):
        problems.append(f"in-flight not back to zero: {f['inflight_requests_end']}")
    over = {k: v for k, v in f["index_blocks_per_endpoint"].items() if v > args.capacity}
    if over:
        problems.append(f"index over capacity: {over}")
    # Flat memory: allow 20% over the post-warm-up level (allocator noise, Redis client pools).
    if f["rss_growth_mib"] > 0.2 * f["rss_mib_after_warmup"]:
        problems.append(f"RSS grew {f['rss_growth_mib']} MiB")
    for p in problems:
        print("FAIL:", p)
    if not problems:
        print("PASS: no picker-caused errors, in-flight at zero, index within capacity")
    return not problems


if __name__ == "__main__":
    sys.exit(main())
