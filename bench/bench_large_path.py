"""The picker's per-request Python work on a large new prompt, this tree against another
checkout of extproc loaded in the same process, alternated request by request (so a loaded
machine weighs on both alike): `parse_request` (decode, prompt, token estimate, canonical
stream, block keys), the live-sessions lookup of the default profile, and the memory index's
write of the new chain (three endpoints, unbounded, as `extproc serve` runs by default).

    git archive main | tar -x -C /tmp/base
    uv run python bench/bench_large_path.py --baseline /tmp/base [--kb 400,4096] [--requests 200]

CPU time per request (`time.process_time`), medians and quartiles.
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from bench_bodies import unique
from bench_parse import chat_body


def load(tree: str | None) -> dict[str, ModuleType]:
    """extproc's modules from `tree` (None: this one), under their own names, then removed
    from sys.modules so another copy can be imported next to them."""
    _forget_extproc()
    if tree is not None:
        sys.path.insert(0, tree)
    importlib.invalidate_caches()
    try:
        names = (
            "extproc.requests",
            "extproc.index.memory",
            "extproc.index.base",
            "extproc.scheduling.plugins.sessions",
        )
        mods = {n: importlib.import_module(n) for n in names}
    finally:
        if tree is not None:
            sys.path.remove(tree)
        _forget_extproc()
    root = Path(mods["extproc.requests"].__file__ or "").parents[2]
    if tree is not None and root != Path(tree).resolve():
        raise SystemExit(f"the baseline loaded from {root}, not {tree}")
    return mods


def _forget_extproc() -> None:
    for name in [m for m in sys.modules if m == "extproc" or m.startswith("extproc.")]:
        del sys.modules[name]


class Path_:
    """One copy's parse + sessions lookup + index write, with its own state."""

    def __init__(self, mods: dict[str, ModuleType]) -> None:
        req = mods["extproc.requests"]
        self.parse = req.parse_request
        self.settings = req.ParseSettings()
        self.index = mods["extproc.index.memory"].MemoryKVIndex(
            mods["extproc.index.base"].IndexOptions()
        )
        self.sessions = mods["extproc.scheduling.plugins.sessions"].LiveSessions(120.0, 50_000)
        self.n = 0

    def run(self, body: bytes) -> float:
        t0 = time.process_time()
        r: Any = self.parse("/v1/chat/completions", {}, body, self.settings)
        self.sessions.find(r.block_keys)
        endpoint = f"10.0.0.{self.n % 3}:8000"
        self.index.record(endpoint, r.block_keys)
        self.sessions.touch(None, endpoint, r.block_keys)
        self.n += 1
        return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", required=True, help="root of another extproc checkout")
    ap.add_argument("--kb", default="400,4096")
    ap.add_argument("--requests", type=int, default=200)
    args = ap.parse_args()
    copies = {"baseline": Path_(load(args.baseline)), "this": Path_(load(None))}
    for kb in (int(k) for k in args.kb.split(",")):
        base = chat_body(kb * 1024)
        n = args.requests if kb < 1024 else max(20, args.requests // 8)
        times: dict[str, list[float]] = {name: [] for name in copies}
        for i in range(n + 5):
            body = unique(base, i)
            for name, copy in copies.items():
                t = copy.run(body)
                if i >= 5:  # warm-up
                    times[name].append(t * 1e3)
        cells = []
        for name, ts in times.items():
            q = statistics.quantiles(ts, n=4)
            cells.append(f"{name} {statistics.median(ts):.3f} ms (IQR {q[0]:.3f}-{q[2]:.3f})")
        ratio = statistics.median(times["this"]) / statistics.median(times["baseline"])
        print(f"| {kb} KB | {' | '.join(cells)} | {ratio:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
