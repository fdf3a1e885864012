"""The live-session record's per-request work, this tree against another checkout of extproc
loaded in the same process, rounds alternated (so a loaded machine weighs on both alike).

Each request does what `bounded-sessions-filter` asks of `LiveSessions` with its defaults
(growth learned and shared, uncontinued first turns learned): `find`, then for a new session
`settle`, `learned` and `counts`, then `touch`. A third of the requests start a session on
one of a few shared prompts, the rest continue a live one; the clock moves 50 ms a request, so
first turns pass their horizon and are settled on the way.

    git archive main | tar -x -C /tmp/base
    uv run python bench/bench_session_record.py --baseline /tmp/base [--blocks 64,2048]

CPU time per request (`time.process_time` over a round), medians over rounds. Then, this
tree only, what `reset` (an endpoint restarted or left) costs on a full record: a scan of
every chain, once per reset.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_large_path import load

_SESSIONS_MODULE = "extproc.scheduling.plugins.sessions"


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _requests(blocks: int, n: int, seed: int) -> list[tuple[int, ...]]:
    """`n` prompts: a new session (a shared prompt of `blocks`, then its own 8 blocks) or the
    next turn of an earlier one (its previous turn, then 8 more)."""
    rng = random.Random(seed)
    shared = [tuple(range(p * 1_000_000, p * 1_000_000 + blocks)) for p in range(4)]
    live: list[tuple[int, ...]] = []
    out: list[tuple[int, ...]] = []
    for i in range(n):
        if not live or rng.random() < 1 / 3:
            keys = (*rng.choice(shared), *range(10**9 + 100 * i, 10**9 + 100 * i + 8))
            live.append(keys)
        else:
            j = rng.randrange(len(live))
            keys = (*live[j], *range(2 * 10**9 + 100 * i, 2 * 10**9 + 100 * i + 8))
            live[j] = keys
        out.append(keys)
    return out


def _round(live_sessions: Any, reqs: list[tuple[int, ...]], blocks: int) -> float:
    clock = _Clock()
    live = live_sessions(
        120.0, 50_000, clock, learn_growth=True, share_growth=True, learn_uncontinued=True
    )
    t0 = time.process_time()
    for i, keys in enumerate(reqs):
        clock.now += 0.05
        chain = live.find(keys, (blocks,))
        if chain is None:
            live.settle()
            live.learned(keys, blocks)
            live.counts()
        live.touch(chain, f"10.0.0.{i % 4}:8000", keys)
    return (time.process_time() - t0) / len(reqs)


def _reset_ms(live_sessions: Any, chains: int, endpoints: int = 4) -> list[float]:
    """Milliseconds for each `reset` of `endpoints` endpoints in turn, on a record holding
    `chains` live sessions spread over them."""
    live = live_sessions(1e9, chains, _Clock())
    for i in range(chains):
        live.touch(None, f"10.0.0.{i % endpoints}:8000", (3 * i, 3 * i + 1, 3 * i + 2))
    out = []
    for e in range(endpoints):
        t0 = time.perf_counter()
        live.reset(f"10.0.0.{e}:8000")
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="root of another extproc checkout")
    ap.add_argument("--blocks", default="64,2048", help="shared prompt lengths, blocks")
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--reset-chains", type=int, default=50_000, help="0: no reset figure")
    args = ap.parse_args()
    copies = {
        "baseline": load(args.baseline)[_SESSIONS_MODULE].LiveSessions,
        "this": load(None)[_SESSIONS_MODULE].LiveSessions,
    }
    for blocks in (int(b) for b in args.blocks.split(",")):
        reqs = _requests(blocks, args.requests, seed=blocks)
        times: dict[str, list[float]] = {name: [] for name in copies}
        for r in range(args.rounds + 1):
            # Alternate which copy goes first; the first round is a warm-up.
            order = list(copies.items()) if r % 2 == 0 else list(reversed(copies.items()))
            for name, cls in order:
                t = _round(cls, reqs, blocks)
                if r:
                    times[name].append(t * 1e6)
        cells = [f"{name} {statistics.median(ts):.2f} us" for name, ts in times.items()]
        ratio = statistics.median(times["this"]) / statistics.median(times["baseline"])
        print(f"| {blocks} blocks | {' | '.join(cells)} | {ratio:.3f}x |", flush=True)
    if args.reset_chains:
        ms = [m for _ in range(args.rounds) for m in _reset_ms(copies["this"], args.reset_chains)]
        print(
            f"reset, {args.reset_chains} live sessions: median {statistics.median(ms):.2f} ms, "
            f"max {max(ms):.2f} ms ({len(ms)} resets)",
            flush=True,
        )


if __name__ == "__main__":
    main()
