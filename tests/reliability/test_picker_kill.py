"""extproc killed (SIGKILL) and restarted under load, through a real Envoy: what each failure
mode promises, measured. Fail closed: 500s only between the kill and the picker being seen
healthy again. Fail open: once the health check sees the picker down, Envoy's own balancing
serves everything. Two replicas behind one health-checked picker cluster: the survivor
takes the traffic."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import aiohttp
import httpx
import pytest
import yaml

from extproc import stack as stack_module
from extproc.bootstrap import build_bootstrap
from extproc.stack import Stack, StackOptions, free_port, grpc_health_status, wait_until
from tests.reliability.conftest import figure

CHAT = b'{"model": "m", "messages": [{"role": "user", "content": "hello there"}]}'


@dataclass
class Timeline:
    """(seconds since start, status) of every request; status 0 = the client saw an error."""

    t0: float = field(default_factory=time.monotonic)
    events: list[tuple[float, int]] = field(default_factory=list)
    marks: dict[str, float] = field(default_factory=dict)
    health: list[tuple[float, int]] = field(default_factory=list)

    def mark(self, name: str) -> None:
        self.marks[name] = time.monotonic() - self.t0

    def between(self, start: float, end: float = float("inf")) -> list[int]:
        return [s for t, s in self.events if start <= t < end]


async def load(
    url: str,
    tl: Timeline,
    seconds: float,
    clients: int = 4,
    *,
    until: asyncio.Event | None = None,
) -> None:
    """`seconds` of load; with `until`, also at least until that event plus `seconds` / 4
    (a restart takes as long as the machine makes it, and the test needs load after it)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http:

        def going(end: float) -> bool:
            if time.monotonic() < end:
                return True
            if until is None:
                return False
            if not until.is_set():
                return time.monotonic() < end + 60  # a restart that never ends fails below
            return time.monotonic() < max(end, tl.marks.get("healthy", 0) + tl.t0 + seconds / 4)

        async def client() -> None:
            end = time.monotonic() + seconds
            while going(end):
                sent = time.monotonic() - tl.t0
                try:
                    async with http.post(
                        f"{url}/v1/chat/completions",
                        data=CHAT,
                        headers={"content-type": "application/json"},
                    ) as r:
                        await r.read()
                        status = r.status
                except aiohttp.ClientError:
                    status = 0
                tl.events.append((sent, status))
                await asyncio.sleep(0.01)

        await asyncio.gather(*(client() for _ in range(clients)))


async def watch_health(stack: Stack, tl: Timeline, stop: asyncio.Event) -> None:
    """Samples how many picker hosts Envoy counts healthy, every 50 ms, into tl.health."""
    while not stop.is_set():
        n = await in_thread(stack.picker_healthy_in_envoy)
        tl.health.append((time.monotonic() - tl.t0, n))
        await asyncio.sleep(0.05)


def flapped_near(tl: Timeline, t: float, slack_s: float = 0.3) -> bool:
    """Envoy counted no healthy picker around `t`: health checks of a live picker failed
    (1 s timeout, two misses), as can happen when the machine is starved."""
    return any(n == 0 and abs(ts - t) <= slack_s for ts, n in tl.health)


async def in_thread(fn, *args):
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


def test_fail_closed_gives_500s_only_while_the_picker_is_gone():
    with Stack(StackOptions(upstreams=2)) as stack:
        tl = Timeline()

        async def scenario() -> None:
            async def faults() -> None:
                await asyncio.sleep(1.0)
                tl.mark("kill")
                await in_thread(stack.stop_extproc, signal.SIGKILL)
                await asyncio.sleep(1.0)
                tl.mark("restart")
                await in_thread(stack.start_extproc)
                await in_thread(stack.wait_picker_healthy, 30.0)
                tl.mark("healthy")
                healthy.set()

            stop, healthy = asyncio.Event(), asyncio.Event()
            watcher = asyncio.create_task(watch_health(stack, tl, stop))
            await asyncio.gather(load(stack.url, tl, 6.0, until=healthy), faults())
            stop.set()
            await watcher

        asyncio.run(scenario())
        hc = stack.envoy_stats("cluster.extproc.health_check.")
    m = tl.marks
    gap = tl.between(m["kill"], m["healthy"])
    failed = [s for s in gap if s != 200]
    late = [round(t - m["healthy"], 3) for t, st in tl.events if t >= m["healthy"] and st != 200]
    figure(
        "picker_kill_fail_closed",
        requests=len(tl.events),
        failed=len(failed),
        failed_after_healthy_s=late[:8],
        health_check_failures=hc.get("cluster.extproc.health_check.failure", 0),
        statuses_in_gap=sorted(set(gap)),
        gap_s=round(m["healthy"] - m["kill"], 2),
        restart_to_healthy_s=round(m["healthy"] - m["restart"], 2),
    )
    assert set(failed) <= {503}, "fail closed answers 503 (picker-unavailable), nothing else"
    assert failed, "the outage was not visible: the test did not kill anything"
    # Outside the outage every request is served, unless Envoy saw the live picker down at
    # that moment (a health-check flap, reported in the figure): fail closed still holds.
    # (A request sent just before the kill may still be mid-stream when it lands: on a
    # starved machine one takes hundreds of ms, and 0.1 s of slack failed once, 3 requests
    # sent 0.14 s before the kill.)
    outside = [(t, st) for t, st in tl.events if t < m["kill"] - 0.5 or t >= m["healthy"] + 0.1]
    assert {st for _, st in outside} <= {200, 503}
    unexplained = [t for t, st in outside if st != 200 and not flapped_near(tl, t)]
    assert not unexplained, f"503s outside the outage with the picker seen healthy: {unexplained}"
    assert any(st == 200 for t, st in outside if t >= m["healthy"]), "never served again"


def test_a_picker_seen_healthy_again_is_routed_at_once():
    """Envoy holds a health change that follows the previous one within its merge window (1 s
    by default) before its worker threads see it, while the admin stats count the host healthy
    at once; the picker cluster sets no window. The scenario makes the two changes close: the
    picker frozen (SIGSTOP) until seen down, resumed at once, and health-checked every 0.3 s,
    so the next check passes well inside a second of the down. Every request sent from
    100 ms after the admin stats count it healthy again must be served."""
    opts = StackOptions(upstreams=1, health_interval_s=0.3)
    with Stack(opts) as stack, httpx.Client(base_url=stack.url, timeout=10) as client:
        assert client.post("/v1/chat/completions", content=CHAT).status_code == 200
        pid = stack._procs["extproc"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: stack.picker_healthy_in_envoy() == 0, timeout_s=30,
                       what="the frozen picker seen down")  # fmt: skip
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: stack.picker_healthy_in_envoy() > 0, timeout_s=30,
                   what="the picker seen healthy again")  # fmt: skip
        healthy = time.monotonic()
        sent: list[tuple[float, int]] = []
        while time.monotonic() - healthy < 1.5:
            t = time.monotonic() - healthy
            sent.append((t, client.post("/v1/chat/completions", content=CHAT).status_code))
        merged = stack.envoy_stats("cluster_manager.").get(
            "cluster_manager.cluster_updated_via_merge", 0
        )
    failed = [round(t, 3) for t, st in sent if st != 200]
    figure("picker_back_routed", requests=len(sent), failed_s=failed[:8], updates_merged=merged)
    assert not [t for t in failed if t >= 0.1], f"not routed after seen healthy: {failed}"
    assert merged == 0, "a health change was held back by Envoy's merge window"


def test_no_picker_reachable_is_a_json_error():
    """Fail closed with every picker down: a JSON error body (issue 18), not a bare 500."""
    with Stack(StackOptions(upstreams=1)) as stack:
        ok = httpx.post(f"{stack.url}/v1/chat/completions", content=CHAT, timeout=10)
        stack.stop_extproc(signal.SIGKILL)
        r = httpx.post(f"{stack.url}/v1/chat/completions", content=CHAT, timeout=10)
    figure("picker_down_reply", status=r.status_code, content_type=r.headers.get("content-type"),
           body_bytes=len(r.content))  # fmt: skip
    assert ok.status_code == 200
    assert r.status_code == 503
    assert r.headers["content-type"] == "application/json"
    assert r.json()["error"]["code"] == "picker_unavailable"
    assert r.headers["x-llm-d-request-dropped-reason"] == "picker-unavailable"
    assert r.headers["retry-after"] == "1"


def test_a_stalled_picker_refuses_with_a_reason():
    """Issue 15: a picker starved of CPU for a few seconds (here frozen with SIGSTOP) is
    health-checked down; every request until it is seen up again is refused by Envoy. Each
    of those is a 503 with the reason header and `retry-after` (they were bare 500s, counted
    lost by the overload bench), and the picker serves again once resumed."""
    with Stack(StackOptions(upstreams=1)) as stack, httpx.Client(base_url=stack.url,
                                                                 timeout=10) as client:  # fmt: skip
        assert client.post("/v1/chat/completions", content=CHAT).status_code == 200
        pid = stack._procs["extproc"].pid
        os.kill(pid, signal.SIGSTOP)
        try:
            wait_until(lambda: stack.picker_healthy_in_envoy() == 0, timeout_s=30,
                       what="the frozen picker seen down")  # fmt: skip
            during = [client.post("/v1/chat/completions", content=CHAT) for _ in range(3)]
        finally:
            os.kill(pid, signal.SIGCONT)
        wait_until(lambda: stack.picker_healthy_in_envoy() > 0, timeout_s=30,
                   what="the picker seen healthy again")  # fmt: skip
        after = wait_until(
            lambda: client.post("/v1/chat/completions", content=CHAT).status_code == 200,
            timeout_s=10, what="served again",
        )  # fmt: skip
    figure("picker_stalled_reply", statuses=[r.status_code for r in during],
           reasons=[r.headers.get("x-llm-d-request-dropped-reason") for r in during])  # fmt: skip
    for r in during:
        assert r.status_code == 503, r.text
        assert r.headers.get("x-llm-d-request-dropped-reason") == "picker-unavailable"
        assert r.headers.get("retry-after") == "1"
        assert r.json()["error"]["code"] == "picker_unavailable"
    assert after is not False


def test_fail_open_routes_by_envoy_once_the_picker_is_seen_down():
    opts = StackOptions(upstreams=2, lb="override-host", fail_open=True)
    with Stack(opts) as stack:
        tl = Timeline()

        def seen_down() -> None:
            name = "cluster.extproc.membership_healthy"
            wait_until(
                lambda: stack.envoy_stats(name).get(name) == 0, timeout_s=5, what="picker down"
            )

        async def scenario() -> None:
            async def faults() -> None:
                await asyncio.sleep(1.0)
                tl.mark("kill")
                await in_thread(stack.stop_extproc, signal.SIGKILL)
                await in_thread(seen_down)
                tl.mark("seen_down")

            await asyncio.gather(load(stack.url, tl, 4.0), faults())

        asyncio.run(scenario())
    m = tl.marks
    window, after = tl.between(m["kill"], m["seen_down"]), tl.between(m["seen_down"] + 0.1)
    figure(
        "picker_kill_fail_open",
        requests=len(tl.events),
        failed_before_seen_down=sum(s != 200 for s in window),
        statuses_before_seen_down=sorted(set(window)),
        kill_to_seen_down_s=round(m["seen_down"] - m["kill"], 2),
        served_after=len(after),
    )
    assert after and set(after) == {200}


class Replica:
    """A second picker process on a port chosen before Envoy starts."""

    def __init__(self, port: int, endpoints: list[str], log_path) -> None:
        self.port = port
        self.health = free_port()
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "extproc",
                    "serve",
                    "--endpoints",
                    ",".join(endpoints),
                    "--host",
                    "127.0.0.1",
                    "--port",
                    str(port),
                    "--health-port",
                    str(self.health),
                    "--admin-port",
                    "0",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        wait_until(
            lambda: grpc_health_status(self.health, "readiness") == 1,
            timeout_s=20,
            what="replica",
            proc=self.proc,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(15)


@pytest.fixture
def two_replica_bootstrap(monkeypatch: pytest.MonkeyPatch) -> int:
    """Stack's bootstrap with a second host in the picker cluster; returns its port."""
    port = free_port()

    def render(opts):
        doc = build_bootstrap(opts)
        for cluster in doc["static_resources"]["clusters"]:
            if cluster["name"] == "extproc":
                hosts = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
                address = {"socket_address": {"address": "127.0.0.1", "port_value": port}}
                hosts.append({"endpoint": {"address": address}})
        return yaml.safe_dump(doc, sort_keys=False)

    monkeypatch.setattr(stack_module, "render_bootstrap", render)
    return port


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM], ids=["SIGKILL", "SIGTERM"])
def test_two_replicas_one_killed_under_load(two_replica_bootstrap: int, sig: int):
    """SIGTERM (a rollout) loses nothing: the replica reports NOT_SERVING but keeps serving for
    `drain_delay_s`, longer than Envoy's health check takes to stop sending to it. SIGKILL
    loses nothing either since issue 18: an ext_proc stream that cannot be opened on the dead
    replica is retried on the survivor (grpc_service retry_policy, previous_hosts), and the
    first refused connection ejects the dead one (outlier detection) before the health check
    notices. Asserted: no failure at all (unless Envoy saw no healthy picker: a flap)."""
    port = two_replica_bootstrap
    drain = 3.0 if sig == signal.SIGTERM else 0.0
    with Stack(StackOptions(upstreams=2, drain_delay_s=drain)) as stack:
        replica = Replica(port, stack.upstream_addresses, stack.log_dir / "r2.log")
        try:
            wait_until(
                lambda: stack.picker_healthy_in_envoy() == 2, timeout_s=10, what="both healthy"
            )
            tl = Timeline()

            async def scenario() -> None:
                async def faults() -> None:
                    await asyncio.sleep(1.5)
                    tl.mark("kill")
                    await in_thread(stack.stop_extproc, sig)
                    tl.mark("killed")  # the process is gone (waited for)
                    await in_thread(
                        lambda: wait_until(
                            lambda: stack.picker_healthy_in_envoy() == 1,
                            timeout_s=5,
                            what="replica seen down",
                        )
                    )
                    tl.mark("seen_down")

                stop = asyncio.Event()
                watcher = asyncio.create_task(watch_health(stack, tl, stop))
                await asyncio.gather(load(stack.url, tl, 5.0), faults())
                stop.set()
                await watcher

            asyncio.run(scenario())
            stats = stack.envoy_stats("http.inference.ext_proc.")
            stats |= stack.envoy_stats("cluster.extproc.health_check.")
            stats |= stack.envoy_stats("cluster.extproc.upstream_rq_retry")
            stats |= stack.envoy_stats("cluster.extproc.outlier_detection.ejections_enforced")
        finally:
            replica.stop()
    m = tl.marks
    failed = [(round(t - m["kill"], 3), s) for t, s in tl.events if s != 200]
    health_failures = stats.get("cluster.extproc.health_check.failure", 0)
    figure(
        f"picker_kill_two_replicas[{signal.Signals(sig).name}]",
        requests=len(tl.events),
        failed=len(failed),
        failed_sent_after_death=sum(m["kill"] + t >= m["killed"] for t, _ in failed),
        first_failure_s=failed[0][0] if failed else None,
        last_failure_s=failed[-1][0] if failed else None,
        kill_to_seen_down_s=round(m["seen_down"] - m["kill"], 2),
        ext_proc_streams_failed=stats.get("http.inference.ext_proc.streams_failed", 0),
        health_check_failures=health_failures,
        stream_retries=stats.get("cluster.extproc.upstream_rq_retry", 0),
        outlier_ejections=stats.get(
            "cluster.extproc.outlier_detection.ejections_enforced_total", 0
        ),
    )
    # Fail closed: every failure is a 503 with its reason, and once the stopped replica is
    # seen down the survivor serves everything (unless Envoy saw no healthy picker: a flap).
    assert {st for _, st in failed} <= {503}
    settled = m["seen_down"] + 0.1
    unexplained = [
        round(t - m["kill"], 3)
        for t, st in tl.events
        if t >= settled and st != 200 and not flapped_near(tl, t)
    ]
    assert not unexplained, f"failures after the survivor took over: {unexplained}"
    # Neither loses a request sent once the replica is gone (issue 18): SIGTERM drains; after
    # SIGKILL a new stream is retried on the survivor and the dead replica is ejected on its
    # first refused connection. Only a SIGKILLed replica's streams still open at the moment
    # it died can fail (sent before "killed": Envoy cannot replay a stream's sent body).
    lost = [f for f in failed if not flapped_near(tl, m["kill"] + f[0])]
    if sig == signal.SIGKILL:
        lost = [f for f in lost if m["kill"] + f[0] >= m["killed"]]
    assert not lost, failed
