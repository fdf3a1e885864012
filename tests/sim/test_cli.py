"""`python -m extproc.sim` as a real process: ready lines, several servers, clean exit."""

from __future__ import annotations

import asyncio
import signal
import sys

import aiohttp

from extproc.sim.cli import build_arg_parser, server_settings
from extproc.sim.server import SERVED_BY_HEADER


def test_ports_follow_the_base_ports():
    args = build_arg_parser().parse_args(
        ["--servers", "3", "--base-port", "8100", "--kv-events-base-port", "5557", "--fast", "5"]
    )
    settings = server_settings(args)
    assert [s.port for s in settings] == [8100, 8101, 8102]
    assert [s.kv_events.endpoint for s in settings if s.kv_events] == [
        "tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558", "tcp://127.0.0.1:5559"
    ]  # fmt: skip
    assert settings[2].kv_events and settings[2].kv_events.replay_endpoint == "tcp://127.0.0.1:6559"
    assert settings[0].engine.timing.speed == 5


async def test_hosts_several_servers_and_exits_cleanly_on_sigterm():
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "extproc.sim", "--servers", "2", "--base-port", "0",
        "--kv-events-base-port", "0", "--fast", "50",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        lines = []
        async with asyncio.timeout(20):
            for _ in range(2):
                lines.append((await proc.stdout.readline()).decode())
        fields = [dict(kv.split("=", 1) for kv in line.split()[2:]) for line in lines]
        assert all(line.startswith("sim ready ") for line in lines)
        assert all(f["kv_events"].startswith("tcp://") for f in fields)
        async with aiohttp.ClientSession() as http:
            for f in fields:
                body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
                async with http.post(f"{f['url']}/v1/completions", json=body) as resp:
                    assert resp.status == 200
                    assert resp.headers[SERVED_BY_HEADER] == f["name"]
        proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(10):
            assert await proc.wait() == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
