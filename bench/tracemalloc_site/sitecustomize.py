"""Trace the Python heap of every `extproc serve` process a benchmark starts, without touching
the product: put this directory on PYTHONPATH and name an output file.

    PYTHONPATH=bench/tracemalloc_site EXTPROC_TRACEMALLOC_FILE=/tmp/heap.jsonl \\
        .venv/bin/python bench/bench_held_streams.py --tracemalloc ...

(`bench_held_streams.py --tracemalloc` does this itself.) Each SIGUSR2 to a picker runs a
full garbage collection and appends one JSON line to the file: its pid, the traced bytes
now and the peak, and the `top` source lines whose holdings grew the most since the previous
report (one frame each; since tracing began for the first). Other Python
processes (the benchmark, the simulators) are left alone. Tracing costs CPU on every
allocation and memory for every traced block: a traced picker's RSS is not the untraced
one's, so read RSS from a run without it.
"""

from __future__ import annotations

import os
import sys

_FILE = os.environ.get("EXTPROC_TRACEMALLOC_FILE")
_ARGV = getattr(sys, "orig_argv", sys.argv)
if _FILE and "extproc" in _ARGV and "serve" in _ARGV:
    import gc
    import json
    import signal
    import tracemalloc

    _TOP = int(os.environ.get("EXTPROC_TRACEMALLOC_TOP", "12"))
    tracemalloc.start(1)
    _last: list[tracemalloc.Snapshot] = []

    def _report(*_: object) -> None:
        gc.collect()
        current, peak = tracemalloc.get_traced_memory()
        snap = tracemalloc.take_snapshot()
        if _last:
            stats = snap.compare_to(_last[0], "lineno")[:_TOP]
            top = [[str(s.traceback[0]), s.size_diff, s.count_diff] for s in stats]
        else:
            top = [[str(s.traceback[0]), s.size, s.count] for s in snap.statistics("lineno")[:_TOP]]
        _last[:] = [snap]
        line = {"pid": os.getpid(), "current": current, "peak": peak, "top": top}
        with open(_FILE, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")

    signal.signal(signal.SIGUSR2, _report)
