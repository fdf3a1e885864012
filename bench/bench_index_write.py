"""Cost of writing a long new chain into the memory index (`record`), unbounded and under
capacity pressure (each write evicts as much as it adds), optionally against another
version of `extproc/index/memory.py` in the same run (interleaved, medians).

    git show <rev>:extproc/index/memory.py > /tmp/old_memory.py
    uv run python bench/bench_index_write.py [--baseline /tmp/old_memory.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import statistics
import time

from extproc.index.base import IndexOptions
from extproc.index.memory import MemoryKVIndex

BLOCKS = 1582  # a 400 KB chat body's approximate chain


def run(cls: type, cap: int | None, chains: list[tuple[int, ...]]) -> float:
    idx = cls(IndexOptions(capacity_blocks=cap))
    times = []
    for rep in range(6):
        for i, chain in enumerate(chains):
            keys = tuple((k + rep) % (1 << 64) for k in chain)  # a new chain every time
            t0 = time.process_time()
            idx.record(f"10.0.0.{i % 3}:8000", keys)
            times.append(time.process_time() - t0)
    return statistics.median(times[len(chains) :]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--baseline", help="another memory.py to compare with")
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    impls: dict[str, type] = {"this": MemoryKVIndex}
    if args.baseline:
        spec = importlib.util.spec_from_file_location("baseline_memory", args.baseline)
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        impls = {"baseline": module.MemoryKVIndex, **impls}
    rng = random.Random(1)
    chains = [tuple(rng.getrandbits(64) for _ in range(BLOCKS)) for _ in range(60)]
    for cap in (None, 50_000):
        res: dict[str, list[float]] = {name: [] for name in impls}
        for _ in range(args.repeat):
            for name, cls in impls.items():
                res[name].append(run(cls, cap, chains))
        figures = ", ".join(f"{n} {statistics.median(v):.3f} ms" for n, v in res.items())
        print(f"capacity {cap}: record of a new {BLOCKS:,}-block chain (median): {figures}")


if __name__ == "__main__":
    main()
