"""The picker's memory per ext_proc stream held open through a long streamed response, and
whether it comes back when the streams end.

Two ways a stream outlives its response headers (docs/flow-control.md, docs/gateways.md):

- `ours-trailers`: `extproc envoy-config --response-trailers send`; only evictable requests
  (here: objective `sheddable`, the lowest band, `enableEviction`) keep their stream to the
  response's end, the rest end it at the headers. `--objective critical` shows those.
- `llm-d`: the llm-d standalone chart's ext_proc settings (extproc/gateways.py): response
  bodies FULL_DUPLEX_STREAMED, so every stream lasts to the response's end and every body
  chunk passes through the picker.

For each setting one stack (Envoy, `extproc serve` with flow control and eviction, one
simulated server decoding `--decode-tps` tokens/s per request, which sends a streamed
reply's headers at once), then for each N of `--counts`: N streamed chat requests opened
at once, held until every one has its response headers and `--settle-s` more, then ended
(the server sped up so they finish), then `--settle-s` again. The picker's RSS (median of
five samples 0.2 s apart) before, while held and after; bytes per stream =
(held - before) / N. N = 0 is the same steps with no request: the noise of the baseline.
`--tracemalloc` traces the picker's Python heap as well (bench/tracemalloc_site; a traced
picker's RSS is larger and its CPU slower: read RSS from an untraced run).

    uv run python bench/bench_held_streams.py                      # both settings, 0,200,1000,1000
    uv run python bench/bench_held_streams.py --settings llm-d --counts 0,1000 --tracemalloc

The last N repeated shows whether a second round ends higher than the first (a leak) or
reuses what the first left in the allocator. Prints one row per step and a JSON line per
setting (`--json FILE` writes them all).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import psutil
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.gateways import LLM_D, gateway_bootstrap
from extproc.stack import SimFleet, Stack, StackOptions

TRACE_SITE = Path(__file__).resolve().parent / "tracemalloc_site"

OBJECTIVES = """\
kind: InferenceObjective
metadata: {name: critical}
spec: {priority: 5}
---
kind: InferenceObjective
metadata: {name: sheddable}
spec: {priority: -1}
"""


def picker_config(tmp: Path, max_concurrency: int) -> Path:
    """Flow control with eviction, saturated only past `max_concurrency` requests in flight
    (so every request of the bench is dispatched, and a sheddable one is evictable)."""
    (tmp / "objectives.yaml").write_text(OBJECTIVES)
    detector = {"maxConcurrency": max_concurrency}
    cfg = {
        "scheduling": {
            "plugins": [
                {"type": "queue-scorer"},
                {"type": "max-score-picker"},
                {"type": "concurrency-detector", "parameters": detector},
                {"type": "sheddable-eviction-filter"},
                {"type": "priority-then-time-eviction-order-policy"},
            ],
            "flowControl": {
                "defaultRequestTTL": "60s",
                "saturationDetector": {"pluginRef": "concurrency-detector"},
                "enableEviction": True,
            },
            "schedulingProfiles": [
                {
                    "name": "default",
                    "plugins": [{"pluginRef": "queue-scorer"}, {"pluginRef": "max-score-picker"}],
                }
            ],
        },
        "flow_control": {"objectives_file": str(tmp / "objectives.yaml")},
    }
    path = tmp / "picker.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def ours_trailers(opts: BootstrapOptions) -> dict[str, Any]:
    return build_bootstrap(replace(opts, response_trailers="send"))


def llm_d(opts: BootstrapOptions) -> dict[str, Any]:
    return gateway_bootstrap(LLM_D, opts)


SETTINGS: dict[str, Callable[[BootstrapOptions], dict[str, Any]]] = {
    "ours-trailers": ours_trailers,
    "llm-d": llm_d,
}


@dataclass
class Step:
    setting: str
    n: int
    opened: int  # requests whose response headers arrived while held
    complete: int  # of those, streamed to [DONE]
    statuses: dict[str, int]
    rss_before: int
    rss_held: int
    rss_after: int
    heap_before: int | None
    heap_held: int | None
    heap_after: int | None
    open_s: float  # until every response's headers had arrived
    load_start: float
    load_end: float
    # The simulator's wall over scheduled seconds while the streams opened and were held
    # (nan: it ran nothing); their ending, at 1000x speed, loads the machine on purpose.
    lanes: float

    @property
    def per_stream(self) -> float | None:
        return (self.rss_held - self.rss_before) / self.n if self.n else None

    @property
    def heap_per_stream(self) -> float | None:
        if not self.n or self.heap_held is None or self.heap_before is None:
            return None
        return (self.heap_held - self.heap_before) / self.n

    @property
    def heap_held_only(self) -> float | None:
        """Heap per stream that went when the streams did: what holding one costs, without
        what each request leaves behind by design (its index entries, bounded by the
        index's capacity). Meaningful for the heap only: freed RSS stays in the allocator."""
        if not self.n or self.heap_held is None or self.heap_after is None:
            return None
        return (self.heap_held - self.heap_after) / self.n


class Picker:
    """The picker process of a stack: RSS, and the traced heap when it runs traced."""

    def __init__(self, stack: Stack, heap_file: Path | None) -> None:
        self.proc = psutil.Process(stack._procs["extproc"].pid)
        self.heap_file = heap_file
        self.admin = stack.picker_admin_port

    async def rss(self) -> int:
        samples = []
        for _ in range(5):
            samples.append(self.proc.memory_info().rss)
            await asyncio.sleep(0.2)
        return int(statistics.median(samples))

    async def heap(self) -> int | None:
        """Traced bytes after a full collection (bench/tracemalloc_site), or None."""
        if self.heap_file is None:
            return None
        lines = self._lines()
        self.proc.send_signal(signal.SIGUSR2)
        for _ in range(100):
            await asyncio.sleep(0.1)
            now = self._lines()
            if len(now) > len(lines):
                self.top = json.loads(now[-1])["top"]
                return int(json.loads(now[-1])["current"])
        raise TimeoutError("the traced picker wrote no heap line within 10 s")

    def _lines(self) -> list[str]:
        assert self.heap_file is not None
        return self.heap_file.read_text().splitlines() if self.heap_file.exists() else []


def chat(model: str, i: int, max_tokens: int, words: int = 40) -> dict:
    text = " ".join(f"w{i}x{k}" for k in range(words))  # no two requests share a block
    return {
        "model": model,
        "messages": [{"role": "user", "content": f"held stream {i}: {text}"}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def hold_one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    objective: str,
    headed: list[int],
    all_headed: asyncio.Event,
    n: int,
) -> str:
    """Streams one reply to its end; counts its headers in `headed` as they arrive."""
    headers = {"x-llm-d-inference-objective": objective}
    try:
        async with session.post(url, json=body, headers=headers) as r:
            headed[0] += 1
            if headed[0] == n:
                all_headed.set()
            if r.status != 200:
                await r.read()
                return str(r.status)
            async for line in r.content:
                if line.startswith(b"data: [DONE]"):
                    return "complete"
            return "ended"
    except (TimeoutError, aiohttp.ClientError) as exc:
        headed[0] += 1
        if headed[0] == n:
            all_headed.set()
        return type(exc).__name__


def set_speed(fleet: SimFleet, speed: float) -> None:
    for srv in fleet.servers:
        r = httpx.post(f"{srv.url}/sim/speed", json={"relative_speed": speed}, timeout=10)
        r.raise_for_status()


def lane_seconds(fleet: SimFleet) -> tuple[float, float]:
    wall = sched = 0.0
    for srv in fleet.servers:
        d = httpx.get(f"{srv.url}/sim/steps", timeout=10).json()
        wall, sched = wall + d["wall_s"], sched + d["scheduled_s"]
    return wall, sched


async def step(
    setting: str, stack: Stack, picker: Picker, n: int, args: argparse.Namespace
) -> Step:
    assert stack.fleet is not None
    load_start = os.getloadavg()[0]
    lanes0 = lane_seconds(stack.fleet)
    heap_before = await picker.heap()
    rss_before = await picker.rss()
    headed = [0]
    all_headed = asyncio.Event()
    url = f"{stack.url}/v1/chat/completions"
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_read=120)
    t0 = time.monotonic()
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
        bodies = [chat(stack.fleet.model, i, args.output, args.prompt_words) for i in range(n)]
        tasks = [
            asyncio.create_task(hold_one(session, url, b, args.objective, headed, all_headed, n))
            for b in bodies
        ]
        if n:
            await asyncio.wait_for(all_headed.wait(), args.open_timeout_s)
        open_s = time.monotonic() - t0
        await asyncio.sleep(args.settle_s)
        heap_held = await picker.heap()
        rss_held = await picker.rss()
        top_held = getattr(picker, "top", None)
        wall, sched = (b - a for a, b in zip(lanes0, lane_seconds(stack.fleet), strict=True))
        set_speed(stack.fleet, 1000.0)  # what is left of each reply ends at once
        results = await asyncio.gather(*tasks)
    set_speed(stack.fleet, 1.0)
    await asyncio.sleep(args.settle_s)
    heap_after = await picker.heap()
    rss_after = await picker.rss()
    statuses: dict[str, int] = {}
    for r in results:
        statuses[r] = statuses.get(r, 0) + 1
    s = Step(
        setting=setting,
        n=n,
        opened=n,
        complete=statuses.get("complete", 0),
        statuses=statuses,
        rss_before=rss_before,
        rss_held=rss_held,
        rss_after=rss_after,
        heap_before=heap_before,
        heap_held=heap_held,
        heap_after=heap_after,
        open_s=round(open_s, 2),
        load_start=load_start,
        load_end=os.getloadavg()[0],
        lanes=wall / sched if sched > 0 else float("nan"),
    )
    if top_held is not None and n and args.top:
        print(f"  heap held: the lines that grew most since before ({setting} N={n}):")
        for where, size, count in top_held[: args.top]:
            print(f"    {size / 1024:9.1f} KiB {count:7d} blocks  {where}")
    return s


def mib(b: int | None) -> str:
    return "-" if b is None else f"{b / 2**20:8.1f}"


def row(s: Step) -> str:
    per = "-" if s.per_stream is None else f"{s.per_stream / 1024:7.1f}"
    hper = "-" if s.heap_per_stream is None else f"{s.heap_per_stream / 1024:7.1f}"
    if s.heap_held_only is not None:
        hper += f" (held only {s.heap_held_only / 1024:.1f})"
    return (
        f"{s.setting:14s} {s.n:5d} {s.complete:5d} {s.open_s:6.2f} | RSS MiB {mib(s.rss_before)}"
        f" {mib(s.rss_held)} {mib(s.rss_after)} | KiB/stream {per} | heap MiB "
        f"{mib(s.heap_before)} {mib(s.heap_held)} {mib(s.heap_after)} | KiB/stream {hper} | "
        f"load {s.load_start:.2f}->{s.load_end:.2f} lanes {s.lanes:.2f}"
    )


async def run_setting(setting: str, args: argparse.Namespace, tmp: Path) -> list[Step]:
    cfg = picker_config(tmp, max_concurrency=100_000)
    heap_file = tmp / f"heap-{setting}.jsonl" if args.tracemalloc else None
    sim_args = ("--decode-tps", str(args.decode_tps), "--max-num-seqs", "2048",
                "--max-num-batched-tokens", "65536", "--num-gpu-blocks", "400000",
                "--max-model-len", "1000000")  # fmt: skip
    with contextlib.ExitStack() as es:
        # The fleet first, so only the picker (started next) sees the tracing variables.
        fleet = es.enter_context(SimFleet(1, sim_args, log_dir=tmp))
        env = os.environ.copy()
        if heap_file is not None:
            os.environ["PYTHONPATH"] = os.pathsep.join(
                [str(TRACE_SITE), *filter(None, [env.get("PYTHONPATH")])]
            )
            os.environ["EXTPROC_TRACEMALLOC_FILE"] = str(heap_file)
        try:
            opts = StackOptions(
                upstreams=1,
                fleet=fleet,
                extproc_args=("--config", str(cfg)),
                bootstrap=SETTINGS[setting],
                log_dir=tmp / setting,
            )
            stack = es.enter_context(Stack(opts))
        finally:
            os.environ.clear()
            os.environ.update(env)
        picker = Picker(stack, heap_file)
        # Warm-up: lazy imports, the first decisions' caches, the access-log stream.
        async with aiohttp.ClientSession() as session:
            for i in range(20):
                body = chat(fleet.model, -1 - i, 2)
                async with session.post(f"{stack.url}/v1/chat/completions", json=body) as r:
                    await r.read()
        set_speed(fleet, 1.0)
        await asyncio.sleep(1.0)
        steps = []
        for n in args.counts:
            s = await step(setting, stack, picker, n, args)
            print(row(s), flush=True)
            steps.append(s)
        print(f"picker log: {(tmp / setting / 'extproc.log').stat().st_size} bytes")
        return steps


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--settings", nargs="+", default=list(SETTINGS), choices=list(SETTINGS))
    p.add_argument("--counts", type=lambda s: [int(x) for x in s.split(",")],
                   default=[0, 200, 1000, 1000])  # fmt: skip
    p.add_argument("--objective", default="sheddable", help="critical: not evictable")
    # Each reply's remaining tokens stream through Envoy (and, under llm-d, the picker) when
    # the step ends them: 200 made a 1000-stream step take over a minute.
    p.add_argument("--output", type=int, default=24, help="max_tokens of each reply")
    p.add_argument("--prompt-words", type=int, default=40, help="words in each prompt")
    p.add_argument("--decode-tps", type=float, default=0.25, help="tokens/s per request")
    p.add_argument("--settle-s", type=float, default=2.0)
    p.add_argument("--open-timeout-s", type=float, default=90.0)
    p.add_argument("--tracemalloc", action="store_true")
    p.add_argument("--top", type=int, default=0, help="heap lines to print per held step")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    print(f"{sys.argv}; load {os.getloadavg()}", flush=True)
    out = []
    with tempfile.TemporaryDirectory(prefix="held-streams-") as d:
        for setting in args.settings:
            tmp = Path(d) / setting
            tmp.mkdir()
            steps = asyncio.run(run_setting(setting, args, tmp))
            base = steps[0]
            for s in steps:
                rec = {**asdict(s), "per_stream": s.per_stream,
                       "heap_per_stream": s.heap_per_stream,
                       "heap_held_only": s.heap_held_only,
                       "after_minus_first_before": s.rss_after - base.rss_before}  # fmt: skip
                out.append(rec)
                print(json.dumps(rec))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
