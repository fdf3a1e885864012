"""cProfile every `extproc serve` process a benchmark starts, without touching the product:
put this directory on PYTHONPATH and name an output directory.

    PYTHONPATH=bench/cprofile_site EXTPROC_CPROFILE_DIR=/tmp/prof \\
        .venv/bin/python bench/trace_routing.py ...

(`trace_routing.py --profile DIR` does this per run and profiles only while the workload
runs.) Each picker process (its command line has `extproc` and `serve`) writes
`<dir>/serve-<pid>.prof` when it exits (SIGTERM ends `serve` normally, so atexit runs);
other Python processes (the benchmark, the simulators) are left alone. With
`EXTPROC_CPROFILE_ON_SIGNAL=1` the profiler starts off and each SIGUSR2 turns it on or off
(start-up, imports and the idle wait before a workload are then left out). The main
thread's CPU time (`time.thread_time`), not wall time; cProfile slows what it measures
(about 1.5-2x on call-heavy code): for where the CPU goes, not for how much. Read the
profiles with `bench/profile_read.py`.
"""

from __future__ import annotations

import os
import sys

_DIR = os.environ.get("EXTPROC_CPROFILE_DIR")
_ARGV = getattr(sys, "orig_argv", sys.argv)
if _DIR and "extproc" in _ARGV and "serve" in _ARGV:
    import atexit
    import cProfile
    import signal
    import time

    # Waiting in the event loop's poll is no cost: CPU time of the main thread only.
    _prof = cProfile.Profile(time.thread_time)
    _on = [False]

    def _toggle(*_: object) -> None:
        if _on[0]:
            _prof.disable()
        else:
            _prof.enable()
        _on[0] = not _on[0]

    def _dump() -> None:
        _prof.disable()
        os.makedirs(_DIR, exist_ok=True)
        _prof.dump_stats(os.path.join(_DIR, f"serve-{os.getpid()}.prof"))

    atexit.register(_dump)
    if os.environ.get("EXTPROC_CPROFILE_ON_SIGNAL") == "1":
        signal.signal(signal.SIGUSR2, _toggle)
    else:
        _toggle()
