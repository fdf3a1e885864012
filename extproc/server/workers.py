"""`extproc serve --workers N`: a parent process that runs N picker processes and keeps them
running. It binds nothing itself; it restarts a worker that died and, on `stop()` (SIGTERM),
forwards SIGTERM so every worker drains, then waits for them.

Workers share the ext_proc and health ports through SO_REUSEPORT (grpc sets it on Linux;
the kernel spreads new connections across them) and the Redis state. Each worker i serves
its admin port at `admin_port + i`, so Prometheus scrapes every worker's own counters.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from extproc.backoff import backoff_s

log = logging.getLogger("extproc.workers")

# A worker that dies sooner than this after its start counts as crashing at once: its next
# restart waits longer, so a worker that cannot start does not spin the CPU.
_FAST_CRASH_S = 5.0
_MAX_BACKOFF_S = 10.0
_POLL_S = 0.1


def worker_argv(argv: Sequence[str], index: int) -> list[str]:
    """The child's command line: the parent's `extproc` arguments without `--workers`,
    plus the worker's index."""
    out: list[str] = []
    skip = False
    for arg in argv:
        if skip:
            skip = False
            continue
        if arg == "--workers":
            skip = True
            continue
        if arg.startswith("--workers="):
            continue
        out.append(arg)
    return [sys.executable, "-m", "extproc", *out, "--worker-index", str(index)]


# The supervisor's pid, in each worker's environment (see `die_with_supervisor`).
SUPERVISOR_ENV = "EXTPROC_SUPERVISOR_PID"
_PR_SET_PDEATHSIG = 1


def die_with_supervisor(environ: dict[str, str] | None = None) -> bool:
    """In a worker, first thing: if the supervisor is SIGKILLed, this process gets SIGTERM
    and drains instead of holding the ports as an orphan (Linux's PR_SET_PDEATHSIG).
    Returns False when the supervisor is already gone (the worker should exit).

    Set by the worker itself, not by a `preexec_fn` between fork and exec: a preexec_fn makes
    subprocess fork the whole (threaded) parent, and a parent that had started gRPC ran gRPC's
    fork handlers in the child, whose poller then died on the descriptors closed before exec:
    workers exited at birth (tests/server/test_workers.py, 1 run in 5 under load). Without
    it, subprocess spawns with vfork and runs nothing of the parent's in the child."""
    env = os.environ if environ is None else environ
    pid = env.get(SUPERVISOR_ENV)
    if pid is None or not sys.platform.startswith("linux"):
        return True
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    # The supervisor may have died between our start and the prctl: then we were already
    # reparented and no signal will come.
    return os.getppid() == int(pid)


@dataclass(slots=True)
class _Slot:
    index: int
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    restart_at: float | None = None
    fast_crashes: int = 0
    restarts: int = 0


class Supervisor:
    """Runs `command(i)` for i in 0..workers-1 until `stop()`. `run()` blocks and returns the
    exit code: 0 when every worker drained and exited cleanly after `stop()`.

    `stop()` only sets a flag and sends signals, so a signal handler may call it."""

    def __init__(
        self,
        command: Callable[[int], Sequence[str]],
        workers: int,
        *,
        grace_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if workers < 1:
            raise ValueError("workers must be >= 1")
        self._command = command
        self._slots = [_Slot(i) for i in range(workers)]
        # Workers drain for up to grace_s (ServerSettings.drain_bound_s: drain delay and
        # the longer stream wait); a little on top for their own teardown.
        self._stop_wait_s = grace_s + 5.0
        self._clock = clock
        self._sleep = sleep
        self._stopping = False
        # Signalled once only: a worker that already drained has dropped its handler, and a
        # second SIGTERM would kill it with -15 instead of the clean exit it is making.
        self._signalled: set[int] = set()

    @property
    def pids(self) -> list[int | None]:
        return [s.proc.pid if s.proc else None for s in self._slots]

    @property
    def restarts(self) -> int:
        return sum(s.restarts for s in self._slots)

    def stop(self) -> None:
        self._stopping = True
        self._forward(signal.SIGTERM)

    def _forward(self, sig: int) -> None:
        for slot in self._slots:
            proc = slot.proc
            if proc is not None and proc.pid not in self._signalled and proc.poll() is None:
                self._signalled.add(proc.pid)
                proc.send_signal(sig)

    def _start(self, slot: _Slot) -> None:
        argv = list(self._command(slot.index))
        slot.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, env={**os.environ, SUPERVISOR_ENV: str(os.getpid())}
        )
        slot.started_at = self._clock()
        slot.restart_at = None
        log.info("worker started", extra={"worker": slot.index, "pid": slot.proc.pid})

    def _check(self, slot: _Slot) -> None:
        now = self._clock()
        if slot.proc is not None:
            rc = slot.proc.poll()
            if rc is None:
                return
            lived = now - slot.started_at
            slot.fast_crashes = slot.fast_crashes + 1 if lived < _FAST_CRASH_S else 0
            # 1 s after the first fast crash, doubling: a crash loop does not spin.
            delay = backoff_s(slot.fast_crashes, 1.0, _MAX_BACKOFF_S)
            log.warning(
                "worker exited, restarting",
                extra={"worker": slot.index, "returncode": rc, "restart_in_s": delay},
            )
            slot.proc = None
            slot.restart_at = now + delay
        if slot.restart_at is not None and now >= slot.restart_at:
            slot.restarts += 1
            self._start(slot)

    def run(self) -> int:
        for slot in self._slots:
            if not self._stopping:
                self._start(slot)
        while not self._stopping:
            for slot in self._slots:
                if self._stopping:
                    break
                self._check(slot)
            self._sleep(_POLL_S)
        # A worker started between the signal and here missed the forwarded SIGTERM.
        self._forward(signal.SIGTERM)
        return self._wait_all()

    def _wait_all(self) -> int:
        deadline = self._clock() + self._stop_wait_s
        code = 0
        for slot in self._slots:
            if slot.proc is None:
                continue
            try:
                rc = slot.proc.wait(timeout=max(0.0, deadline - self._clock()))
            except subprocess.TimeoutExpired:
                log.error("worker did not drain in time, killing", extra={"worker": slot.index})
                slot.proc.kill()
                rc = slot.proc.wait()
            if rc != 0:
                log.warning("worker exited badly", extra={"worker": slot.index, "returncode": rc})
                code = 1
        return code
