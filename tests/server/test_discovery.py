"""A picker whose endpoints come from discovery: a Kubernetes InferencePool (against a local
API server speaking list/watch) or a watched file. Readiness waits for the first sync."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import orjson
import yaml

from extproc.config import DiscoverySettings
from extproc.server import lifecycle
from extproc.server.app import App
from extproc.server.health import NOT_SERVING, SERVING
from extproc.testing import ExtProcClient, body_chunks, destination, post, request_headers
from tests.endpoints.fakekube import PODS, POOLS, FakeKube, pod, pool, pool_discovery

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def destinations(app: App, n: int = 12) -> set[str]:
    out = set()
    async with ExtProcClient(f"127.0.0.1:{app.port}") as c:
        for _ in range(n):
            resp = await c.exchange(
                [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
            )
            out.add(destination(resp[0]))
    return out


async def readiness(app: App) -> int:
    return (await app.health.servicer.Check(_Req("readiness"), None)).status


class _Req:
    def __init__(self, service: str) -> None:
        self.service = service


async def eventually(check, timeout_s: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not await check():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.02)


async def test_inference_pool_pods_become_endpoints_and_follow_changes(settings, tmp_path):
    kube = FakeKube()
    await kube.start()
    try:
        kube.put(POOLS, pool(ports=(8000,)))
        kube.put(PODS, pod("a", "127.0.1.1"))
        kube.put(PODS, pod("b", "127.0.1.2", ready=False))
        s = msgspec.structs.replace(
            settings, endpoints=[], discovery=pool_discovery(tmp_path, kube.url)
        )
        async with App(s, []) as app:
            await eventually(lambda: _is(readiness(app), SERVING))
            assert await destinations(app) == {"127.0.1.1:8000"}
            kube.put(PODS, pod("b", "127.0.1.2", ready=True))
            await eventually(lambda: _has(app, "127.0.1.2:8000"))
            assert await destinations(app, 30) == {"127.0.1.1:8000", "127.0.1.2:8000"}
            kube.delete(PODS, "a")
            kube.delete(PODS, "b")
            await eventually(lambda: _is(readiness(app), NOT_SERVING))
            # The watch's own counters reach /metrics (server/families.py WATCH).
            text = app.metrics.exposition().decode()
            lists = _sample(text, 'extproc_discovery_lists_total{resource="inferencepool"}')
            changes = _sample(text, 'extproc_discovery_changes_total{resource="inferencepool"}')
            assert lists >= 1 and changes >= 1
    finally:
        await kube.stop()


def _sample(text: str, series: str) -> float:
    line = next(x for x in text.splitlines() if x.startswith(series + " "))
    return float(line.rpartition(" ")[2])


async def test_endpoints_file_is_followed(settings, tmp_path: Path):
    path = tmp_path / "endpoints.yaml"
    path.write_text(yaml.safe_dump(["127.0.2.1:8000"]))
    s = msgspec.structs.replace(
        settings, endpoints=[], discovery=DiscoverySettings(endpoints_file=str(path))
    )
    async with App(s, []) as app:
        assert await readiness(app) == SERVING
        assert await destinations(app) == {"127.0.2.1:8000"}
        # A calibration ratio (the extproc_approx_token_ratio gauge) of the endpoint that
        # leaves must leave with it.
        app.calibration.stats.ratios["127.0.2.1:8000"] = 0.8
        path.write_text(yaml.safe_dump([{"address": "127.0.2.9:8000", "labels": {"x": "y"}}]))
        await eventually(lambda: _has(app, "127.0.2.9:8000"), timeout_s=10)
        assert await destinations(app) == {"127.0.2.9:8000"}
        await eventually(lambda: _lacks_ratio(app, "127.0.2.1:8000"), timeout_s=10)
        # A bad file keeps the last set, and says so on /metrics (and in a log line).
        series = "extproc_endpoints_file_failures_total"
        assert _sample(app.metrics.exposition().decode(), series) == 0
        path.write_text("- not-an-address\n")
        app.watches[0].check()  # the watch's next pass, now (its loop polls once a second)
        assert _sample(app.metrics.exposition().decode(), series) == 1
        assert await destinations(app, 3) == {"127.0.2.9:8000"}


async def test_a_crashed_background_loop_shows_on_metrics_and_runs_again(
    settings, caplog, monkeypatch
):
    """A loop that dies is counted per loop (every loop's series present from the start),
    its traceback logged, and it runs again after a backoff (it stayed dead before: what it
    fed went stale for the process's life)."""
    monkeypatch.setattr(lifecycle, "LOOP_RESTART_S", 0.01)
    runs = []

    async def boom() -> None:
        runs.append(1)
        if len(runs) < 3:
            raise RuntimeError("boom")
        await asyncio.Event().wait()  # the third run lives

    async with App(settings, []) as app:
        text = app.metrics.exposition().decode()
        assert _sample(text, 'extproc_background_loop_crashes_total{loop="endpoints"}') == 0
        app.spawn("boom", boom)
        series = 'extproc_background_loop_crashes_total{loop="boom"}'
        await eventually(lambda: _metric(app, series, 2.0))
        await eventually(lambda: _true(len(runs) == 3))
    said = [r.getMessage() for r in caplog.records]
    assert sum("background loop boom crashed; restarting in" in m for m in said) == 2


async def _true(value: bool) -> bool:
    return value


async def _metric(app: App, series: str, value: float) -> bool:
    return _sample(app.metrics.exposition().decode(), series) == value


async def _is(status, expected: int) -> bool:
    return await status == expected


async def _lacks_ratio(app: App, address: str) -> bool:
    return address not in app.calibration.stats.ratios


async def _has(app: App, address: str) -> bool:
    return app.pool.get(address) is not None
