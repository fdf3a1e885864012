"""A thread that notices when the serving event loop stops turning.

One asyncio loop serves every ext_proc stream, the health service and /metrics. When it
stops turning (a blocking call, a plugin that sleeps, a lock taken in C code), every open
stream waits where it is, and under the gateways' settings nothing in Envoy ends the wait:
in FULL_DUPLEX_STREAMED no `message_timeout` is armed and no gRPC deadline applies, so the
requests hang until the connection manager's stream idle timeout (Envoy's default: 300 s;
docs/gateways.md "A slow or frozen picker"). Nothing running on the loop can notice. A
thread can, as long as the process runs: the loop stamps a heartbeat every `tick_s`, and the
thread compares the stamp's age with two bounds.

- `stall_s`: the stall is logged once, with the loop thread's stack (what it is stuck in),
  and counted (`extproc_loop_stalls_total`, visible at /metrics once the loop turns again),
  and its end is logged with its length.
- `exit_s`: the process ends with `STUCK_EXIT_CODE`. Envoy then fails the held streams at
  once (a refusal or a cut response instead of a hang), the supervisor of `--workers` or
  the kubelet starts a fresh process, and new streams go to live pickers. A liveness probe
  alone is slower here: a stuck loop cannot run its SIGTERM handler, so the kubelet's kill
  waits for the whole termination grace period (330 s in the base Deployment), and with
  `--workers` the probe reaches a random worker.

A whole-process freeze (SIGSTOP, the cgroup freezer) stops this thread too; only the
kubelet's liveness probe sees that (deploy/base/deployment.yaml bounds its kill).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("extproc.server.watchdog")

# EX_SOFTWARE: the process ended itself because its serving loop was stuck.
STUCK_EXIT_CODE = 70
# If the exit line cannot be written (the loop may be stuck inside the log handler, on a
# full stderr pipe), the process still ends this long after the decision.
_EXIT_LOG_BOUND_S = 1.0


@dataclass(slots=True)
class WatchdogStats:
    """`stalls`: the loop did not turn for `server.loop_stall_s` or longer, counted once per
    stall; `longest_s`: the longest stall seen (to the watchdog's tick)."""

    stalls: int = 0
    longest_s: float = 0.0


@dataclass(frozen=True, slots=True)
class WatchdogBounds:
    stall_s: float
    exit_s: float | None  # None: log and count only, never exit

    @property
    def tick_s(self) -> float:
        # A quarter of the smaller bound: a stall is seen within a quarter of it.
        return min(self.stall_s, self.exit_s or self.stall_s) / 4


class LoopWatchdog:
    """Start on the loop it watches (`start()`), stop before that loop closes (`stop()`).
    `exit` ends the process (the CLI passes `os._exit`; None: a stall is only logged and
    counted, for processes that embed the picker, such as tests)."""

    def __init__(
        self,
        bounds: WatchdogBounds,
        stats: WatchdogStats,
        *,
        exit: Callable[[int], object] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._bounds = bounds
        self._stats = stats
        self._exit = exit
        self._clock = clock
        self._beat = clock()
        self._loop_thread = 0
        self._handle: asyncio.TimerHandle | None = None
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._loop_thread = threading.get_ident()
        self._beat = self._clock()
        self._tick()
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None
        self._done.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def _tick(self) -> None:
        self._beat = self._clock()
        self._handle = asyncio.get_running_loop().call_later(self._bounds.tick_s, self._tick)

    def _watch(self) -> None:
        tick = self._bounds.tick_s
        worst = 0.0  # the current stall's age so far; 0 while the loop turns
        woke = resumed = self._clock()
        while not self._done.wait(tick):
            now = self._clock()
            if now - woke > tick + self._bounds.stall_s:
                # This thread did not run either, for as long as a stall: the whole process
                # was paused (SIGSTOP, a frozen cgroup, no CPU). The loop is judged from the
                # resumption on, not blamed for the pause.
                resumed = now
            woke = now
            age = now - max(self._beat, resumed)
            if age >= self._bounds.stall_s:
                if not worst:
                    self._stalled(age)
                worst = max(worst, age)
                self._stats.longest_s = max(self._stats.longest_s, worst)
                exit_s = self._bounds.exit_s
                if self._exit is not None and exit_s is not None and age >= exit_s:
                    self._end(age, self._exit)
                    return
            elif worst:
                log.warning(
                    "serving loop turned again after a %.1f s stall",
                    worst,
                    extra={"stall_s": round(worst, 3)},
                )
                worst = 0.0

    def _stalled(self, age: float) -> None:
        self._stats.stalls += 1
        frame = sys._current_frames().get(self._loop_thread)
        stack = "".join(traceback.format_stack(frame)) if frame is not None else "(gone)"
        log.warning(
            "serving loop stalled: no turn for %.1f s; every open stream waits (stack of the "
            "loop thread follows)\n%s",
            age,
            stack,
            extra={"stall_s": round(age, 3)},
        )

    def _end(self, age: float, exit: Callable[[int], object]) -> None:
        # Armed before the log call, which may block behind the stuck loop's handler lock.
        backstop = threading.Timer(_EXIT_LOG_BOUND_S, exit, (STUCK_EXIT_CODE,))
        backstop.daemon = True
        backstop.start()
        log.critical(
            "serving loop stuck for %.1f s (server.loop_stall_exit_s): exiting with code %d "
            "so the held streams fail now and a fresh process takes over",
            age,
            STUCK_EXIT_CODE,
            extra={"stall_s": round(age, 3)},
        )
        for handler in logging.getLogger().handlers:
            # A handler whose stream is gone (closed, broken pipe) must not stop the exit.
            with contextlib.suppress(Exception):
                handler.flush()
        exit(STUCK_EXIT_CODE)
        backstop.cancel()  # reached only when `exit` returns (a test's stand-in)
