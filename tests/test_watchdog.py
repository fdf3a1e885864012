"""The serving loop's watchdog (server/watchdog.py) on a real event loop stuck in a blocking
call: the stall is logged with the stuck stack and counted, its end logged; past the exit
bound the exit function gets the stuck code, once; without one the process only counts."""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import pytest

from extproc.config import ServerSettings
from extproc.server.watchdog import STUCK_EXIT_CODE, LoopWatchdog, WatchdogBounds, WatchdogStats


def blocking_call(s: float) -> None:
    time.sleep(s)


async def run(watchdog: LoopWatchdog, stuck_s: float) -> None:
    watchdog.start()
    try:
        await asyncio.sleep(0.1)
        blocking_call(stuck_s)
        await asyncio.sleep(0.3)
    finally:
        watchdog.stop()


def test_a_stall_is_logged_with_its_stack_and_counted(caplog):
    stats = WatchdogStats()
    caplog.set_level(logging.WARNING, logger="extproc.server.watchdog")
    asyncio.run(run(LoopWatchdog(WatchdogBounds(0.2, None), stats), 0.7))
    assert stats.stalls == 1
    assert 0.4 <= stats.longest_s <= 1.5
    stalled = [r for r in caplog.records if "serving loop stalled" in r.getMessage()]
    assert len(stalled) == 1
    assert "blocking_call" in stalled[0].getMessage()
    assert any("turned again after" in r.getMessage() for r in caplog.records)


def test_a_loop_that_turns_is_not_a_stall():
    stats = WatchdogStats()
    asyncio.run(run(LoopWatchdog(WatchdogBounds(0.3, 1.0), stats, exit=pytest.fail), 0.0))
    assert stats.stalls == 0


def test_past_the_exit_bound_the_process_is_ended(caplog):
    stats = WatchdogStats()
    codes: list[int] = []
    watchdog = LoopWatchdog(WatchdogBounds(0.1, 0.4), stats, exit=codes.append)
    caplog.set_level(logging.CRITICAL, logger="extproc.server.watchdog")
    asyncio.run(run(watchdog, 1.0))
    time.sleep(1.2)  # past the exit line's backstop: still one call
    assert codes == [STUCK_EXIT_CODE]
    assert stats.stalls == 1
    assert any("exiting with code 70" in r.getMessage() for r in caplog.records)


def test_a_log_handler_on_a_closed_stream_does_not_stop_the_exit(tmp_path):
    """The exit path flushes the root handlers; one whose stream is closed (a broken pipe,
    a test harness's stream left behind) raised in the watchdog's thread, which then died
    before calling the exit (seen under pytest-xdist; the backstop timer alone ended it)."""
    stream = (tmp_path / "log").open("w")
    handler = logging.StreamHandler(stream)
    stream.close()
    root = logging.getLogger()
    root.addHandler(handler)
    codes: list[int] = []
    watchdog = LoopWatchdog(WatchdogBounds(0.1, 0.4), WatchdogStats(), exit=codes.append)
    raised: list[BaseException] = []
    before = threading.excepthook
    threading.excepthook = lambda a: raised.append(a.exc_value)  # type: ignore[assignment]
    try:
        asyncio.run(run(watchdog, 0.8))
    finally:
        threading.excepthook = before
        root.removeHandler(handler)
    assert not raised
    assert codes == [STUCK_EXIT_CODE]


def test_a_paused_process_is_not_taken_for_a_stuck_loop():
    """SIGSTOP/SIGCONT stops the watchdog's thread with the loop: on resumption the clock
    has jumped for both, and the loop gets its bound from then on."""
    stats = WatchdogStats()
    codes: list[int] = []
    jump = [0.0]
    watchdog = LoopWatchdog(
        WatchdogBounds(0.2, 1.0),
        stats,
        exit=codes.append,
        clock=lambda: time.monotonic() + jump[0],
    )

    async def paused() -> None:
        watchdog.start()
        try:
            await asyncio.sleep(0.2)
            jump[0] = 30.0  # the process was stopped for 30 s
            blocking_call(0.1)  # the loop's first turn after it, shorter than the bound
            await asyncio.sleep(0.3)
        finally:
            watchdog.stop()

    asyncio.run(paused())
    assert codes == []
    assert stats.stalls == 0


def test_without_an_exit_function_a_long_stall_is_only_counted():
    stats = WatchdogStats()
    asyncio.run(run(LoopWatchdog(WatchdogBounds(0.1, 0.3), stats), 0.8))
    assert stats.stalls == 1


def test_the_exit_bound_must_exceed_the_stall_bound():
    with pytest.raises(ValueError, match="loop_stall_exit_s"):
        ServerSettings(loop_stall_s=5.0, loop_stall_exit_s=5.0)
    assert ServerSettings(loop_stall_exit_s=None).loop_stall_exit_s is None
