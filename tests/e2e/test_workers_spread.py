"""`extproc serve --workers 2 --worker-ports P` behind a real Envoy with our bootstrap
(`extproc_workers=2`): every worker takes streams.

SO_REUSEPORT alone spreads connections, and Envoy multiplexes all of a thread's picker streams
on one HTTP/2 connection, so behind one Envoy every stream used to land on one worker. With one
cluster host per worker port, Envoy's round robin picks a worker per stream: deterministic, no
timing involved (each worker's own admin counter is read)."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from extproc.stack import Stack, StackOptions, wait_until

WORKERS = 2
REQUESTS = 24


def routed(admin_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=5).text
    m = re.search(r'^extproc_requests_total\{[^}]*outcome="routed"[^}]*\} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


def admin_up(port: int) -> bool:
    try:
        return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=1).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def stack():
    with Stack(StackOptions(upstreams=2, workers=WORKERS)) as s:
        yield s


def test_envoy_spreads_streams_over_both_workers(stack: Stack):
    admins = [stack.picker_admin_port + i for i in range(WORKERS)]
    for a in admins:
        wait_until(lambda a=a: admin_up(a), timeout_s=60, what=f"worker admin {a}")
    # Round robin skips a host its health checks have not passed yet: wait for both.
    wait_until(
        lambda: stack.picker_healthy_in_envoy() == WORKERS, timeout_s=30, what="both workers"
    )
    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 50}]}

    def send(i: int) -> int:
        with httpx.Client(base_url=stack.url, timeout=30) as c:
            return c.post("/v1/chat/completions", json=body).status_code

    # Not counted: Envoy's first streams open its connections to the workers (once, in one
    # CI run of seven, all 24 counted streams went to one worker right after start-up).
    with ThreadPoolExecutor(max_workers=8) as pool:
        assert set(pool.map(send, range(8))) == {200}
    before = [routed(a) for a in admins]
    with ThreadPoolExecutor(max_workers=8) as pool:
        statuses = list(pool.map(send, range(REQUESTS)))
    assert statuses == [200] * REQUESTS
    gained = [routed(a) - b for a, b in zip(admins, before, strict=True)]
    assert sum(gained) == REQUESTS
    # Round robin over two hosts gives each about half; > 0 each is what proves the spread.
    assert all(g > 0 for g in gained), gained
