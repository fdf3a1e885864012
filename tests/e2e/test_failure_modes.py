"""What the generated Envoy config promises when the picker is gone."""

from __future__ import annotations

import re
import signal
import time

import httpx

from extproc import protocol
from extproc.stack import Stack, StackOptions, wait_until

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello"}]}


def statuses(stack: Stack, n: int) -> list[int]:
    with httpx.Client(base_url=stack.url, timeout=10) as c:
        return [c.post("/v1/chat/completions", json=CHAT).status_code for _ in range(n)]


def test_fail_closed_by_default_and_recovers_when_the_picker_returns():
    with Stack(StackOptions(upstreams=2)) as stack:
        assert statuses(stack, 3) == [200] * 3
        stack.stop_extproc(signal.SIGKILL)
        # A refusal the client can tell from a failure: 503, its reason, when to retry.
        with httpx.Client(base_url=stack.url, timeout=10) as c:
            refused = [c.post("/v1/chat/completions", json=CHAT) for _ in range(5)]
        assert [r.status_code for r in refused] == [503] * 5
        assert {r.headers.get(protocol.DROPPED_REASON_HEADER) for r in refused} == {
            "picker-unavailable"
        }
        assert all(r.headers.get("retry-after") == "1" for r in refused)
        stack.start_extproc()
        # Envoy health-checks the picker every second; the first routed request ends the wait.
        stack.wait_picker_routing(CHAT)
        assert statuses(stack, 3) == [200] * 3


def test_fail_open_keeps_routing_to_pool_endpoints_once_the_picker_is_seen_down():
    """Requests with a body whose ext_proc stream dies mid-body still fail (Envoy keeps no
    copy of a streamed body); once the health check marks the picker down, at most one
    interval later, every request passes on Envoy's own balancing."""
    opts = StackOptions(upstreams=2, unlisted_upstreams=1, lb="override-host", fail_open=True)
    with Stack(opts) as stack:
        assert statuses(stack, 3) == [200] * 3
        stack.stop_extproc(signal.SIGKILL)
        wait_until(
            lambda: (
                stack.envoy_stats("cluster.extproc.membership_healthy").get(
                    "cluster.extproc.membership_healthy"
                )
                == 0
            ),
            timeout_s=5,
            what="health check marking the picker down",
        )
        with httpx.Client(base_url=stack.url, timeout=10) as c:
            rogue = {protocol.DESTINATION_HEADER: stack.unlisted_addresses[0]}
            for i in range(20):
                # Half the requests try to pick their own upstream while the picker is down.
                r = c.post("/v1/chat/completions", json=CHAT, headers=rogue if i % 2 else None)
                assert r.status_code == 200
                # Envoy's own balancing, over the pool only: the client's header was stripped
                # before ext_proc, so it never reached the load balancer.
                assert r.json()["endpoint"] in stack.upstream_addresses
                assert r.json()["destination_header"] is None


def test_override_host_obeys_the_picker():
    with (
        Stack(StackOptions(upstreams=3, lb="override-host")) as stack,
        httpx.Client(base_url=stack.url, timeout=10) as c,
    ):
        for _ in range(10):
            seen = c.post("/v1/chat/completions", json=CHAT).json()
            assert seen["destination_header"] == seen["endpoint"]


def test_sigterm_drains_and_exits_cleanly():
    """Envoy keeps its access-log stream open as long as its connection: with no request in
    flight the drain closes it at once instead of waiting the whole grace (10 s)."""

    def access_log_streams() -> float:
        text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
        found = re.search(r"^extproc_access_log_streams (\S+)$", text, re.M)
        return float(found.group(1)) if found else 0.0

    with Stack(StackOptions(upstreams=1)) as stack:
        assert statuses(stack, 2) == [200] * 2
        wait_until(lambda: access_log_streams() >= 1, timeout_s=5, what="access-log stream")
        started = time.monotonic()
        assert stack.stop_extproc(signal.SIGTERM) == 0
        assert time.monotonic() - started < 5
