"""Per-request trace of one pressure workload through extproc: what the index matched on each
endpoint at the decision, where the request went, and what the engine really served from its
cache, so approximate and precise mode can be compared decision by decision.

    uv run --extra envoy python bench/trace_routing.py --workload agentic

Each request carries the operator's explain token; the picker answers with its decision
(`x-extproc-decision`: per-endpoint prefix matches, scores, predicted cached tokens). The
engine's `cached_tokens` is the truth the prediction is held against. One line per request
is written as JSON to `--out` (one file per mode), and a summary is printed: how often the
chosen endpoint's predicted hit was below / equal to / above what it served, the tokens
mispredicted, and TTFT percentiles.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import tempfile
import time
from dataclasses import replace
from datetime import datetime
from pathlib import Path

import aiohttp
import httpx
import psutil
import yaml
from bench_routing import (
    AGENTIC,
    PRESSURE_SHAPE,
    SERVERS,
    SIM_ARGS,
    _default_profile_with_all,
    redis_server,
    sglang_router,
    stretched,
    tenants_spec,
    workload,
)
from lanes import lane_clock, lane_delta, lane_line  # bench/lanes.py
from sglang_peer import install_sglang  # bench/sglang_peer.py

from extproc.protocol import DECISION_HEADER, EXPLAIN_HEADER
from extproc.sim import SERVED_BY_HEADER, TIMING_HEADER
from extproc.sim.sessions import build_sessions
from extproc.sim.workload import WorkItem, arrival_offsets, build_workload
from extproc.stack import SimFleet, Stack, StackOptions

TOKEN = "trace-routing-token"


async def _send(
    http: aiohttp.ClientSession, url: str, item: WorkItem, t0: float, explain: bool = True
) -> dict:
    # "group" names an agentic session (their items all have group 0); "tenant" is the
    # tenants workload's group, 0 included (its biggest tenant).
    row: dict = {
        "index": item.index, "group": item.group or item.conversation, "tenant": item.group,
        "conversation": item.conversation, "turn": item.turn,
    }  # fmt: skip
    start = time.perf_counter()
    row["sent_s"] = start - t0
    try:
        async with http.post(
            f"{url}/v1/chat/completions",
            json=item.body,
            headers={TIMING_HEADER: "1", **({EXPLAIN_HEADER: TOKEN} if explain else {})},
            timeout=aiohttp.ClientTimeout(total=120),
        ) as resp:
            row["status"] = resp.status
            row["served_by"] = resp.headers.get(SERVED_BY_HEADER, "")
            raw = resp.headers.get(DECISION_HEADER)
            row["decision"] = json.loads(raw) if raw else None
            async for line in resp.content:
                line = line.strip()
                if line.startswith(b": timing "):
                    # The engine's share of TTFT (KV wait, prefill lane wait, prefill); the
                    # rest is outside it: picker, proxy, HTTP, the engine's tokenizer.
                    parts = dict(kv.split(b"=") for kv in line[9:].split())
                    row["engine_s"] = sum(
                        float(parts[k]) for k in (b"kv_wait_s", b"lane_wait_s", b"prefill_s")
                    )
                    # Each part too: a slower request waited for KV room (a running request
                    # must end) or for the prefill lane (a prefill ahead of it).
                    row["engine_parts"] = {
                        k.decode(): float(v) for k, v in parts.items() if k.endswith(b"_s")
                    }
                    continue
                if not line.startswith(b"data:") or line[5:].strip() == b"[DONE]":
                    continue
                chunk = json.loads(line[5:])
                if "ttft_s" not in row and any(
                    (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
                ):
                    row["ttft_s"] = time.perf_counter() - start
                usage = chunk.get("usage")
                if usage:
                    row["prompt_tokens"] = usage.get("prompt_tokens", 0)
                    details = usage.get("prompt_tokens_details") or {}
                    row["cached_tokens"] = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        row["error"] = repr(exc)
    row["total_s"] = time.perf_counter() - start
    return row


async def _agentic(
    url: str, sessions: int, seed: int, time_scale: float = 1.0, explain: bool = True
) -> list[dict]:
    turns = build_sessions(replace(AGENTIC, sessions=sessions, seed=seed))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()

        async def one(k: int, items: list[WorkItem]) -> list[dict]:
            await asyncio.sleep(k * AGENTIC.stagger_s / time_scale)
            out = []
            for item in items:
                out.append(await _send(http, url, item, t0, explain))
                await asyncio.sleep(AGENTIC.think_s / time_scale)
            return out

        per = await asyncio.gather(*(one(k, s) for k, s in enumerate(turns)))
    return sorted((r for rs in per for r in rs), key=lambda r: r["sent_s"])


async def _tenants(
    url: str,
    rate: float,
    seed: int,
    time_scale: float = 1.0,
    explain: bool = True,
    name: str = "tenants",
) -> list[dict]:
    """An open-loop workload's requests at `rate`: tenants, or bench_routing's multimodal
    (12 groups x 5 one-shot prompts sharing the group's images)."""
    spec = tenants_spec(seed) if name == "tenants" else workload(name, 12, seed)
    items = build_workload(spec)
    offsets = arrival_offsets(len(items), rate * time_scale, seed)
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        t0 = time.perf_counter()

        async def at(item: WorkItem, off: float) -> dict:
            await asyncio.sleep(off)
            return await _send(http, url, item, t0, explain)

        rows = await asyncio.gather(*(at(i, o) for i, o in zip(items, offsets, strict=True)))
    return sorted(rows, key=lambda r: r["sent_s"])


def summarize(mode: str, rows: list[dict]) -> str:
    ok = [r for r in rows if r.get("status") == 200 and r.get("decision")]
    below = above = equal = 0
    missed = phantom = 0
    for r in ok:
        pred = r["decision"]["predicted_cached_tokens"]
        real = r.get("cached_tokens", 0)
        if real > pred + 16:
            below += 1
            missed += real - pred
        elif real < pred - 16:
            above += 1
            phantom += pred - real
        else:
            equal += 1
    ttft = sorted(r["ttft_s"] for r in ok if "ttft_s" in r)
    pct = lambda q: ttft[min(len(ttft) - 1, int(q * len(ttft)))] if ttft else float("nan")  # noqa: E731
    spread: dict[str, int] = {}
    for r in ok:
        spread[r["served_by"]] = spread.get(r["served_by"], 0) + 1
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    cached = sum(r.get("cached_tokens", 0) for r in ok)
    timed = [r for r in ok if "ttft_s" in r and "engine_s" in r]
    engine = sorted(r["engine_s"] for r in timed)
    outside = sorted(r["ttft_s"] - r["engine_s"] for r in timed)

    def mid(xs: list[float]) -> float:
        return xs[len(xs) // 2] if xs else float("nan")

    # Per deciding picker (replica): decisions, degraded lookups, lookup seconds p50 / p90.
    pickers: dict[int, list[dict]] = {}
    for r in ok:
        pickers.setdefault(r["decision"].get("picker", 0), []).append(r)
    per_picker = []
    for rs in pickers.values():
        lk = sorted(r["decision"].get("lookup_s", 0.0) for r in rs)
        deg = sum(bool(r["decision"].get("index_degraded")) for r in rs)
        per_picker.append(
            f"{len(rs)} decided, {deg} degraded, lookup p50 {mid(lk) * 1e3:.1f} ms "
            f"p90 {lk[int(0.9 * len(lk))] * 1e3:.1f} ms"
        )
    return (
        f"{mode:<12} ok {len(ok)}/{len(rows)} hit {cached / max(prompt, 1):.1%} "
        f"TTFT p50 {pct(0.5):.3f} p90 {pct(0.9):.3f} (median in the engine {mid(engine):.3f}, "
        f"outside it {mid(outside):.3f}, sum outside {sum(outside):.2f}) | "
        "predicted hit vs served: "
        f"under {below} (tokens {missed}), equal {equal}, over {above} (tokens {phantom}) | "
        f"spread {'/'.join(str(n) for n in sorted(spread.values(), reverse=True))}"
        + "".join(f"\n  picker: {line}" for line in per_picker)
    )


_HEALTH = {
    "lookups_degraded_total": "degraded",
    "lookups_timed_out_total": "timed out",
    "lookups_failed_total": "failed",
    "lookups_late_total": "late",
    "lookups_in_grace_total": "in grace",
    "lookup_budget_seconds": "budget s",
}


def _lookup_health(admin_port: int) -> str:
    """One replica's index lookups by outcome (why each degraded one was degraded; the rest
    met an open breaker) and its current adaptive budget."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    got = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        short = _HEALTH.get(name.removeprefix("extproc_index_"))
        if short and name.startswith("extproc_index_"):
            got[short] = float(value)
    return "lookups: " + ", ".join(f"{k} {got[k]:g}" for k in _HEALTH.values() if k in got)


def _exchange_line(admin_port: int) -> str:
    """One replica's view of the peers' placements through the in-flight exchange: the
    tokens dated as arrivals (from the peers' placement counters) against what the growth
    of their totals alone showed (the dating before the counters)."""
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    got: dict[str, float] = {}
    for line in text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith("extproc_shared_inflight_"):
            got[name.removeprefix("extproc_shared_inflight_").removesuffix("_total")] = float(value)
    arrived, growth = got.get("peer_arrived_tokens", 0.0), got.get("peer_growth_tokens", 0.0)
    if not arrived:
        return "exchange: no peers' arrivals counted"
    return (
        f"exchange: peers' arrived tokens {arrived:.0f} ({got.get('peer_arrivals', 0):.0f} "
        f"requests), their totals' growth {growth:.0f} ({growth / arrived:.1%} shown), "
        f"counter resets {got.get('counter_resets', 0):.0f}, legacy peers "
        f"{got.get('legacy_peers', 0):.0f}, pushed {got.get('pushed_arrivals', 0):.0f} "
        f"(late {got.get('push_late', 0):.0f}, refused {got.get('push_refused', 0):.0f}, "
        f"unconfirmed {got.get('push_unconfirmed', 0):.0f})"
    )


def _role(proc: psutil.Process) -> str:
    cmd = " ".join(proc.cmdline())
    if "extproc.sim" in cmd:
        return "simulators"
    if "redis-server" in cmd:
        return "redis"
    if "envoy" in proc.name():
        return "envoy"
    return "pickers" if "serve" in cmd else proc.name()


def _profile_env(out: Path) -> None:
    """The pickers started from now on profile themselves into `out` once signalled."""
    site = str(Path(__file__).resolve().parent / "cprofile_site")
    path = os.environ.get("PYTHONPATH", "")
    if site not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(x for x in (site, path) if x)
    os.environ["EXTPROC_CPROFILE_DIR"] = str(out.resolve())
    os.environ["EXTPROC_CPROFILE_ON_SIGNAL"] = "1"


def _toggle_profiles() -> None:
    """Turns every picker's profiler on or off (SIGUSR2, bench/cprofile_site)."""
    for child in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if _role(child) == "pickers":
                child.send_signal(signal.SIGUSR2)


def cpu_seconds() -> dict[str, float]:
    """CPU seconds (user + system) so far of this process (the load generator) and of each
    child by role (simulators, pickers, envoy, redis): what the machine spent on whom."""
    me = psutil.Process()
    out = {"load generator": sum(me.cpu_times()[:2])}
    for child in me.children(recursive=True):
        with contextlib.suppress(psutil.Error):
            role = _role(child)
            out[role] = out.get(role, 0.0) + sum(child.cpu_times()[:2])
    return out


def _size(path: Path) -> int:
    return path.stat().st_size if path.exists() else 0


_RECALIBRATED = re.compile(
    r"^(\S+ \S+) INFO extproc\.calibration approximate keys recalibrated: (\{.*?\}) \((.*)\)"
)
_CAPACITY = re.compile(r"^(\S+ \S+) INFO extproc\.index\.capacity capacity ratio (.*)")


def recalibrations(log: Path, offset: int, epoch0: float) -> list[dict]:
    """One picker's calibration changes in its log past `offset` (this run's part): seconds
    since the load started, what changed, and why (an engine's count, or adopted)."""
    if not log.exists():
        return []
    with log.open("rb") as f:
        f.seek(offset)
        text = f.read().decode(errors="replace")
    out = []
    for line in text.splitlines():
        if m := _RECALIBRATED.match(line):
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append({"at_s": round(at - epoch0, 2), "change": m.group(2), "why": m.group(3)})
        elif m := _CAPACITY.match(line):  # what the KV-capacity ratio did at the change
            at = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").timestamp()
            out.append({"at_s": round(at - epoch0, 2), "change": "capacity", "why": m.group(2)})
    return out


def _calibration_line(rows: list[dict], changes: dict[str, list[dict]]) -> str:
    """How many requests were decided with an uncalibrated token estimate (the picker's
    estimate under 0.6 of the engine's count: at 4 bytes per token for the simulator's ~1.3
    characters it is ~0.33, calibrated ~1.3), the last of them, and when each picker's
    bytes per token changed (with its KV-capacity ratio after the change)."""
    late = [
        r["sent_s"] for r in rows
        if r.get("prompt_tokens") and r.get("decision")
        and r["decision"].get("prompt_tokens", 0) < 0.6 * r["prompt_tokens"]
    ]  # fmt: skip
    per = "; ".join(
        f"{n}: " + (", ".join(
            f"{c['at_s']:.1f} s {c['change']}{' adopted' if 'adopted' in c['why'] else ''}"
            if c["change"] != "capacity" else "capacity " + re.findall(r"[\d.]+", c["why"])[-1]
            for c in cs if "bytes_per_token" in c["change"] or c["change"] == "capacity"
        ) or "none")
        for n, cs in changes.items()
    )  # fmt: skip
    last = f", last sent at {max(late):.1f} s" if late else ""
    return f"decided uncalibrated: {len(late)}{last} | bytes per token changed: {per}"


def _trace_plain(
    name: str,
    router: contextlib.AbstractContextManager[str],
    fleet: SimFleet,
    args,
    load: float,
    rnd: int,
    explain: bool = True,
) -> str:
    """One run through a router that gives no decision (sglang-router, Envoy alone, or the
    picker without the explain token) on the same fleet: where each request went, what it
    hit, and the time outside the engine (router, proxy, HTTP, the engine's tokenizer), so
    the picker's hop can be held against Envoy alone's on the same workload."""
    with router as url:
        urls = [srv.url for srv in fleet.servers]
        lanes0 = lane_clock(urls)
        if args.workload == "agentic":
            rows = asyncio.run(_agentic(url, int(load), args.seed, args.time_scale, explain))
        else:
            rows = asyncio.run(
                _tenants(url, load, args.seed, args.time_scale, explain, args.workload)
            )
        lanes = lane_delta(lanes0, lane_clock(urls))
    out = args.out / f"{args.workload}-{name}-{rnd}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ok = [r for r in rows if r.get("status") == 200]
    prompt = sum(r.get("prompt_tokens", 0) for r in ok)
    cached = sum(r.get("cached_tokens", 0) for r in ok)
    spread: dict[str, int] = {}
    for r in ok:
        spread[r["served_by"]] = spread.get(r["served_by"], 0) + 1

    def pct(xs: list[float], q: float) -> float:
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

    ttft = [r["ttft_s"] for r in ok if "ttft_s" in r]
    outside = [r["ttft_s"] - r["engine_s"] for r in ok if "ttft_s" in r and "engine_s" in r]
    hop = (
        f" | outside the engine p50 {pct(outside, 0.5) * 1e3:.1f} ms p90 "
        f"{pct(outside, 0.9) * 1e3:.1f} ms ({len(outside)} timed)"
        if outside else ""
    )  # fmt: skip
    return (
        f"{name:<12} ok {len(ok)}/{len(rows)} hit {cached / max(prompt, 1):.1%} "
        f"TTFT p50 {pct(ttft, 0.5):.3f} p90 {pct(ttft, 0.9):.3f}{hop} | spread "
        f"{'/'.join(str(n) for n in sorted(spread.values(), reverse=True))}\n  {lane_line(lanes)}"
    )


@contextlib.contextmanager
def _envoy_alone(fleet: SimFleet, log_dir: Path):
    """Envoy balancing the fleet round-robin, no picker: the routing bench's baseline."""
    with Stack(StackOptions(fleet=fleet, log_dir=log_dir, picker=False)) as stack:
        yield stack.url


@contextlib.contextmanager
def _quiet_picker(opts: StackOptions):
    with Stack(opts) as stack:
        time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's socket
        yield stack.url


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--workload", choices=("agentic", "tenants", "multimodal", "text"), default="agentic"
    )
    p.add_argument("--load", type=float, help="sessions (agentic) or req/s (tenants)")
    p.add_argument(
        "--modes", nargs="+", default=["approximate", "precise"],
        help="approximate, precise, precise-events-only (no placement corrections); "
        "approximate on a fresh Redis: redis1 (1 replica), redis3 (3 replicas), "
        "redis3-shared (3 replicas, state.shared_placements), redis3-cal (3 replicas, "
        "state.shared_calibration: true), redis3-unpooled (3 replicas, "
        "state.shared_calibration: false: the default before the fourteenth session, auto "
        "now pools with a Redis index), redis3-scrapes (3 replicas, state.shared_scrapes: "
        "true: the replicas divide the scrapes, as auto does now), redis3-unshared (its "
        "false: every replica scrapes every server, the default before the fifteenth "
        "session), redis3-unpushed (3 replicas, state.shared_inflight.push: false: the "
        "peers' placements come with the exchange alone, the default before the sixteenth "
        "session), redis3-obs (3 replicas, state.shared_observations: true: prefill-speed "
        "samples and new-prefix picks shared); a redis mode + '-drained': predicted-ttft-scorer's "
        "peerInflight: drained (the default); + '-whole': its peerInflight: whole (the "
        "default before); + '-sharedlane': its peerInflight: sharedLane (the peers' drain "
        "behind the replica's own in-flight tokens); + '-lane': its inflightFloor: drained; "
        "+ '-first': its inflightFloor: untilFirstToken; + '-wq': its waitingFloor: "
        "endpointMean; + '-kv': kv-cache-utilization-scorer's countRequest: true; + '-wqkv': "
        "both; + '-bounded': bounded-sessions-filter's keepTogetherGrowth: 0 (every new "
        "session bounded, the default before the sixteenth session); + '-kvfit': "
        "predicted-ttft-scorer's kvFit: wait; + '-kvfitarr': kvFit: wait with kvFitPeers: "
        "arrivals (the peers' placements since the scrape from the in-flight exchange); + "
        "'-kvfitheld': kvFit: wait, kvFitPrefix: held, kvFitMargin: 0 (the nineteenth "
        "session's kvFit); + '-kvfitnomargin': kvFit: wait, kvFitMargin: 0; + '-fleetmean': "
        "its meanPlacements: fleet (the waiting floor's mean over every replica's "
        "placements; the default now); + '-ownmean': meanPlacements: own (the default "
        "before the twenty-first session); + '-coldscored': no-hit-lru-scorer's recordCold: "
        "scored (picks new on the scored candidates move the LRU too); + '-writtenfleet': "
        "its writtenPlacements: fleet (the peers' placements count as written into the "
        "caches, for the eviction cost; the default now); + '-writtenown': "
        "writtenPlacements: own (the default before the twenty-fourth session); + '-spill': "
        "predicted-ttft-scorer's spillCost: fleetBusy; any mode + "
        "'-request': state.prefill_speed: request (the per-request prefill "
        "speed, the default before); + '-units': its speedUnits: estimates; + '-capfirst' "
        "(after the others, before '-request'): "
        "index.capacity_first_tokens: 4000; 'sglang': sglang-router cache_aware on the same "
        "fleet (no decisions: where each request went and what it hit); 'round-robin': "
        "Envoy alone on the same fleet (the routing bench's baseline)",
    )  # fmt: skip
    p.add_argument(
        "--quiet", action="store_true",
        help="picker modes without the explain token (no decision header to build and "
        "send): the hop as bench_routing.py sees it; rows and summary as sglang's",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=1)
    p.add_argument(
        "--warm", type=float, metavar="RATE",
        help="open-loop workloads: first run the workload at RATE req/s with seed - 1 on the "
        "same picker and fleet (bench_routing's step before), untraced; the caches keep "
        "what it wrote unless --warm-reset",
    )  # fmt: skip
    p.add_argument(
        "--warm-reset", action="store_true",
        help="empty the servers' prefix caches after --warm (bench_routing --step-caches "
        "reset, its steps before the twenty-fifth session)",
    )  # fmt: skip
    p.add_argument("--rounds", type=int, default=1, help="modes interleaved, this many times")
    p.add_argument("--out", type=Path, default=Path("trace"))
    p.add_argument("--extra", default="", help="YAML merged into every picker config")
    p.add_argument("--logs", type=Path, help="keep the stacks' logs here (default: discarded)")
    p.add_argument(
        "--profile", type=Path, metavar="DIR",
        help="cProfile the pickers while the workload runs (bench/cprofile_site): one "
        "directory of profiles per run under DIR, read with bench/profile_read.py",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=1.0, metavar="T",
        help="as bench_routing.py's: simulators x T as fast, arrivals x T the rate, think "
        "times / T; the traces and TTFTs stay in wall seconds",
    )  # fmt: skip
    args = p.parse_args(argv)
    load = args.load or (8 if args.workload == "agentic" else 24)
    servers, sim_args = PRESSURE_SHAPE.get(args.workload, (SERVERS, SIM_ARGS))
    sim_args = stretched(sim_args, args.time_scale)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = []
    with tempfile.TemporaryDirectory(prefix="trace-routing-") as tmp:
        log_dir = args.logs or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        with SimFleet(servers, sim_args, log_dir=log_dir) as fleet:
            sglang_venv = None
            for rnd, named in ((r, m) for r in range(args.rounds) for m in args.modes):
                fleet.reset()
                if named == "sglang":
                    if sglang_venv is None:
                        sglang_venv, version = install_sglang(Path(tmp))
                        print(f"sglang-router {version}", flush=True)
                        if sglang_venv is None:
                            continue
                    router = sglang_router(fleet, sglang_venv, log_dir)
                    lines.append(_trace_plain("sglang", router, fleet, args, load, rnd))
                    print(lines[-1], flush=True)
                    continue
                if named == "round-robin":
                    router = _envoy_alone(fleet, log_dir)
                    lines.append(_trace_plain(named, router, fleet, args, load, rnd))
                    print(lines[-1], flush=True)
                    continue
                cfg: dict = {"server": {"explain_tokens": [TOKEN]}}
                mode = named.removesuffix("-request")
                if named != mode:
                    cfg["state"] = {"prefill_speed": "request"}
                if mode.endswith("-capfirst"):  # the KV-capacity ratio measured early
                    mode = mode.removesuffix("-capfirst")
                    cfg["index"] = {"capacity_first_tokens": 4000}
                if mode.startswith("precise"):
                    cfg |= fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}")
                if mode == "precise-events-only":
                    cfg["index"]["kv_events"]["credit_placements"] = False
                ttft, kv = "predicted-ttft-scorer", "kv-cache-utilization-scorer"
                suffixes: dict[str, dict[str, dict]] = {
                    "-sharedlane": {ttft: {"peerInflight": "sharedLane"}},
                    "-units": {ttft: {"speedUnits": "estimates"}},
                    "-drained": {ttft: {"peerInflight": "drained"}},
                    "-whole": {ttft: {"peerInflight": "whole"}},
                    "-lane": {ttft: {"inflightFloor": "drained"}},
                    "-first": {ttft: {"inflightFloor": "untilFirstToken"}},
                    "-wqkv": {ttft: {"waitingFloor": "endpointMean"}, kv: {"countRequest": True}},
                    "-wq": {ttft: {"waitingFloor": "endpointMean"}},
                    "-kv": {kv: {"countRequest": True}},
                    "-bounded": {"bounded-sessions-filter": {"keepTogetherGrowth": 0}},
                    "-unbounded": {"bounded-sessions-filter": {"epsilon": 1000}},
                    "-kvfit": {ttft: {"kvFit": "wait"}},
                    "-kvfitarr": {ttft: {"kvFit": "wait", "kvFitPeers": "arrivals"}},
                    "-kvfitheld": {
                        ttft: {"kvFit": "wait", "kvFitPrefix": "held", "kvFitMargin": 0}
                    },
                    "-kvfitnomargin": {ttft: {"kvFit": "wait", "kvFitMargin": 0}},
                    "-fleetmean": {ttft: {"meanPlacements": "fleet"}},
                    "-ownmean": {ttft: {"meanPlacements": "own"}},
                    "-coldscored": {"no-hit-lru-scorer": {"recordCold": "scored"}},
                    "-writtenfleet": {ttft: {"writtenPlacements": "fleet"}},
                    "-writtenown": {ttft: {"writtenPlacements": "own"}},
                    "-spill": {ttft: {"spillCost": "fleetBusy"}},
                }
                suffix = next((x for x in suffixes if mode.endswith(x)), "")
                if suffix:
                    cfg |= yaml.safe_load(_default_profile_with_all(suffixes[suffix]))
                base = mode.removesuffix(suffix) if suffix else mode
                if base == "redis3-shared":
                    cfg["state"] = {**cfg.get("state", {}), "shared_placements": True}
                if base == "redis3-cal":
                    cfg["state"] = {**cfg.get("state", {}), "shared_calibration": True}
                if base == "redis3-scrapes":
                    cfg["state"] = {**cfg.get("state", {}), "shared_scrapes": True}
                if base == "redis3-unshared":
                    cfg["state"] = {**cfg.get("state", {}), "shared_scrapes": False}
                if base == "redis3-unpushed":
                    cfg["state"] = {**cfg.get("state", {}), "shared_inflight": {"push": False}}
                if base == "redis3-obs":
                    cfg["state"] = {**cfg.get("state", {}), "shared_observations": True}
                if base == "redis3-unpooled":
                    cfg["state"] = {**cfg.get("state", {}), "shared_calibration": False}
                for k, v in (yaml.safe_load(args.extra) or {}).items():
                    cfg[k] = {**cfg.get(k, {}), **v}
                path = log_dir / f"{named}.yaml"
                path.write_text(yaml.safe_dump(cfg))
                ex = contextlib.ExitStack()
                replicas = {
                    "redis1": 1, "redis3": 3, "redis3-shared": 3, "redis3-cal": 3,
                    "redis3-unpooled": 3, "redis3-scrapes": 3, "redis3-unshared": 3,
                    "redis3-unpushed": 3, "redis3-obs": 3,
                }.get(base)  # fmt: skip
                names = ["extproc", *(f"extproc-{i}" for i in range(1, replicas or 1))]
                log_at = {n: _size(log_dir / f"{n}.log") for n in names}
                redis_url = ex.enter_context(redis_server(log_dir)) if replicas else None
                opts = StackOptions(
                    fleet=fleet, log_dir=log_dir, extproc_args=("--config", str(path)),
                    allow_explain=True, replicas=replicas or 1, redis_url=redis_url,
                )  # fmt: skip
                if args.quiet:
                    quiet = _quiet_picker(opts)
                    with ex:
                        lines.append(_trace_plain(named, quiet, fleet, args, load, rnd, False))
                    print(lines[-1], flush=True)
                    continue
                if args.profile:
                    _profile_env(args.profile / f"{args.workload}-{named}-{rnd}")
                with ex, Stack(opts) as stack:
                    time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's socket
                    if args.warm and args.workload != "agentic":
                        # bench_routing's ladder: the step before on the same picker (seed
                        # one lower), so this one is decided calibrated, as there.
                        asyncio.run(
                            _tenants(
                                stack.url, args.warm, args.seed - 1, args.time_scale,
                                name=args.workload,
                            )
                        )  # fmt: skip
                        if args.warm_reset:
                            fleet.reset()
                    if args.profile:
                        _toggle_profiles()
                    urls = [srv.url for srv in fleet.servers]
                    lanes0 = lane_clock(urls)
                    cpu0, wall0, epoch0 = cpu_seconds(), time.perf_counter(), time.time()
                    if args.workload == "agentic":
                        rows = asyncio.run(
                            _agentic(stack.url, int(load), args.seed, args.time_scale)
                        )
                    else:
                        rows = asyncio.run(
                            _tenants(
                                stack.url, load, args.seed, args.time_scale, name=args.workload
                            )
                        )
                    cpu1, wall = cpu_seconds(), time.perf_counter() - wall0
                    if args.profile:
                        _toggle_profiles()
                    cpu = {k: round(v - cpu0.get(k, 0.0), 2) for k, v in cpu1.items()}
                    lanes = lane_delta(lanes0, lane_clock(urls))
                    admin = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
                    corrections = [
                        line for line in httpx.get(admin, timeout=10).text.splitlines()
                        if line.startswith("extproc_precise_placement_corrections_total")
                    ]  # fmt: skip
                    admins = [stack.picker_admin_port, *(a for _, _, a in stack.replica_ports)]
                    corrections += [_lookup_health(a) for a in admins] if replicas else []
                    if (replicas or 1) > 1:
                        corrections += [_exchange_line(a) for a in admins]
                    # Each picker's /metrics at the run's end (scrapes, exchanges, CPU...).
                    for k, a in enumerate(admins):
                        dest = args.out / f"{args.workload}-{named}-{rnd}.metrics-{k}.txt"
                        dest.write_text(httpx.get(f"http://127.0.0.1:{a}/metrics", timeout=10).text)
                out = args.out / f"{args.workload}-{named}-{rnd}.jsonl"
                out.write_text("".join(json.dumps(r) + "\n" for r in rows))
                (args.out / f"{args.workload}-{named}-{rnd}.cpu.json").write_text(
                    json.dumps({"wall_s": round(wall, 2), "cpu_s": cpu, "lanes": lanes})
                )
                changes = {
                    n: recalibrations(log_dir / f"{n}.log", log_at[n], epoch0) for n in names
                }
                (args.out / f"{args.workload}-{named}-{rnd}.calib.json").write_text(
                    json.dumps(changes)
                )
                corrections.append(_calibration_line(rows, changes))
                corrections.append(lane_line(lanes))
                corrections.append(
                    f"CPU s over {wall:.1f} s: "
                    + ", ".join(f"{k} {v:.1f}" for k, v in sorted(cpu.items()))
                )
                lines.append(summarize(named, rows) + "".join(f"\n  {c}" for c in corrections))
                print(lines[-1], flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
