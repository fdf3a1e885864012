"""Ending a test's leftover load at once: once its checks are done, a test speeds its
simulated servers up (`POST /sim/speed`) so the requests still running there finish in a
few milliseconds instead of streaming on at the speed the checks needed.

Why not just leave them: whoever waits for them waits out the whole tail (a thread pool's
exit, an `await` on the request's status, a second request queued behind it), and a stack
stopped with requests still in a simulated server waits up to 10 s for its graceful
shutdown before killing it (`SimFleet.close`). Measured per test in bench/RESULTS.md,
twentieth session (trim)."""

from __future__ import annotations

import httpx

from extproc.stack import SimFleet

# Far past any rate a test runs at (20-2,000 tokens/s): what is left of a minute-long answer
# or a 40 s prefill takes well under a second.
FAST = 1000.0


def finish_fast(fleet: SimFleet) -> None:
    """Speeds every server of `fleet` up by `FAST`: what they run ends almost at once. Call
    it only after the last check that needs their speed, and only on a fleet no later test
    shares (the servers stay fast)."""
    for srv in fleet.servers:
        r = httpx.post(f"{srv.url}/sim/speed", json={"relative_speed": FAST}, timeout=5)
        r.raise_for_status()
