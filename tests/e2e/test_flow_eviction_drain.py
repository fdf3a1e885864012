"""`--response-trailers send` keeps an ext_proc stream open to its response's end so flow
control can cut the response; Envoy resets a response whose stream fails (ext_proc is
fail-closed), so a picker that exits with streams open cuts their responses. Two things
narrow that (server/cut_streams.py): a request nothing can cut (here a critical one) ends
its stream with OK at its response headers, and a draining picker (SIGTERM) ends the
evictable requests' streams with OK at once. Both responses then run on to their end;
only a SIGKILLed picker still cuts the evictable response under way."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import httpx
import yaml

from extproc.stack import Stack, StackOptions
from tests.e2e.sim_speed import finish_fast
from tests.e2e.test_flow_control import metric
from tests.e2e.test_flow_eviction_cut import (
    SIM,
    finished,
    picker_config,
    sim_figure,
    stream_reply,
    warm_up,
)
from tests.e2e.test_flow_eviction_cut import with_trailers as send


async def stop_while_streaming(tmp: Path, sig: int) -> tuple[str, str, float]:
    """A critical and a sheddable response decoding, then the picker stopped with `sig`:
    how each ended, and the requests the engine finished since (a cut one is not)."""
    args = picker_config(tmp)
    cfg = yaml.safe_load((tmp / "picker.yaml").read_text())
    # Short, so that a stream still open when the grace ends shows quickly.
    cfg["server"] = {"grace_s": 1.0}
    (tmp / "picker.yaml").write_text(yaml.safe_dump(cfg))
    with Stack(StackOptions(upstreams=1, sim_args=SIM, extproc_args=args, bootstrap=send)) as s:
        model = s.fleet.model
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(base_url=s.url, timeout=30) as c:
            await warm_up(c, model)
            done = finished(s)
            d1, d2 = loop.create_future(), loop.create_future()
            critical = asyncio.create_task(stream_reply(c, model, 1, d1, objective="critical"))
            shed = asyncio.create_task(stream_reply(c, model, 2, d2))
            await asyncio.wait_for(asyncio.gather(d1, d2), 10)
            assert sim_figure(s, "num_requests_running") == 2
            # Only the sheddable one's stream is held (the critical one's ended at its
            # response headers), and the picker says so.
            assert metric(s, "extproc_flow_cuttable_streams") == 1
            code = await asyncio.to_thread(s.stop_extproc, sig)
            assert code == (0 if sig == signal.SIGTERM else -signal.SIGKILL)
            await asyncio.sleep(1.5)  # past the grace: a stream left open is reset by now
            finish_fast(s.fleet)
            ends = await asyncio.wait_for(asyncio.gather(critical, shed), 10)
            return ends[0], ends[1], finished(s) - done


async def test_a_draining_picker_lets_every_response_under_way_finish(tmp_path: Path):
    assert await stop_while_streaming(tmp_path, signal.SIGTERM) == ("complete", "complete", 2)


async def test_a_killed_picker_cuts_only_the_evictable_response(tmp_path: Path):
    # The critical request's stream ended at its response headers: nothing of it is left
    # for a dead picker to cut. The sheddable one's was open, so Envoy reset it.
    assert await stop_while_streaming(tmp_path, signal.SIGKILL) == ("complete", "truncated", 1)
