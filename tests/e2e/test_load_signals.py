"""Scraped load reaches scheduling in `extproc serve`: with one simulated vLLM server busy
(load the picker never placed, so only its `/metrics` can tell), requests through Envoy go
to the idle one, and `/debug/state` shows the figures scheduling used."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import signal
import time

import httpx
import pytest

from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.sim_speed import finish_fast

# Two running at a time and a small KV cache: the load shows as waiting requests and KV use.
SIM = ("--max-num-seqs", "2", "--num-gpu-blocks", "64", "--decode-tps", "20")


# The load scorers named: this proves scraped load reaches them (the default profile since
# issue 14 ranks by predicted TTFT instead, and is judged by its own tests).
PROFILE = """
scheduling:
  plugins:
    - type: queue-scorer
    - type: kv-cache-utilization-scorer
    - type: no-hit-lru-scorer
    - type: max-score-picker
  schedulingProfiles:
    - name: default
      plugins:
        - {pluginRef: queue-scorer, weight: 2}
        - {pluginRef: kv-cache-utilization-scorer, weight: 2}
        - {pluginRef: no-hit-lru-scorer, weight: 2}
        - {pluginRef: max-score-picker}
"""


@pytest.fixture(scope="module")
def sim_stack(tmp_path_factory):
    cfg = tmp_path_factory.mktemp("load") / "picker.yaml"
    cfg.write_text(PROFILE)
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack:
        yield stack


def debug_state(stack: Stack) -> dict[str, dict]:
    r = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/debug/state", timeout=5)
    return {row["address"]: row["state"] for row in r.json()["endpoints"]}


def test_traffic_moves_away_from_a_server_loaded_behind_the_pickers_back(sim_stack: Stack):
    moves_off_a_busy_server(sim_stack)


def test_the_default_profile_moves_off_a_server_loaded_behind_the_pickers_back():
    """The same check with no scheduling config: predicted TTFT counts the busy server's
    scraped waiting requests as queued prefill from the first request on."""
    with Stack(StackOptions(upstreams=2, sim_args=SIM)) as stack:
        moves_off_a_busy_server(stack)


def moves_off_a_busy_server(sim_stack: Stack) -> None:
    busy, idle = sim_stack.upstream_addresses
    state = httpx.get(f"http://127.0.0.1:{sim_stack.picker_admin_port}/debug/state").json()
    assert state["signals"]["scraped-metrics"] is True

    def load(i: int) -> int:
        body = {"model": sim_stack.fleet.model, "prompt": f"load {i} " * 60, "max_tokens": 80}
        return httpx.post(f"http://{busy}/v1/completions", json=body, timeout=120).status_code

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        pending = [pool.submit(load, i) for i in range(8)]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            # One snapshot that shows the whole load: between two of the busy server's
            # requests it runs one, not two, for an instant.
            seen = debug_state(sim_stack)
            s = seen[busy]
            if s["waiting"] >= 4 and s["running"] == 2 and not s["is_stale"]:
                break
            time.sleep(0.05)
        assert seen[busy]["waiting"] >= 4 and seen[busy]["running"] == 2, seen
        assert seen[busy]["kv_usage"] > 0.5 and seen[idle]["waiting"] == 0, seen
        served = collections.Counter()
        # What the picker saw of the busy server before each request it sent there: the
        # failure message then tells a stale scrape from a scoring fault.
        seen_before_busy: list[dict] = []
        with httpx.Client(base_url=sim_stack.url, timeout=60) as http:
            for i in range(20):
                before = debug_state(sim_stack)[busy]
                body = {
                    "model": sim_stack.fleet.model,
                    "prompt": f"fresh {i} " * 20,
                    "max_tokens": 1,
                }
                r = http.post("/v1/completions", json=body)
                assert r.status_code == 200
                served[r.headers["x-served-by"]] += 1  # the simulated server's own name
                if r.headers["x-served-by"] == busy:
                    seen_before_busy.append(before)
        # The load has done its part: ended now, not 16 s of decoding later (the pool's
        # exit waits for it).
        finish_fast(sim_stack.fleet)
        for f in pending:
            f.cancel()
    # Without scraped load the two tie on every in-flight figure and split the fresh prefixes.
    assert served[idle] >= 18, (served, seen_before_busy)


class Taught:
    """A stack whose picker has placed one long prompt (approximate mode learns its prefix
    from the decision), and what the picker's admin port says about it."""

    def __init__(self, stack: Stack) -> None:
        self.stack = stack
        self.body = {"model": stack.fleet.model, "prompt": "a long shared document " * 80}
        self.admin = f"http://127.0.0.1:{stack.picker_admin_port}"
        assert self.send() == 200

    def send(self) -> int:
        body = {**self.body, "max_tokens": 1}
        return httpx.post(f"{self.stack.url}/v1/completions", json=body, timeout=60).status_code

    def held(self) -> dict[str, float]:
        """Prefix blocks the index credits each endpoint with, for the taught prompt."""
        path = {"x-extproc-path": "/v1/completions"}
        r = httpx.post(f"{self.admin}/debug/explain", json=self.body, headers=path, timeout=5)
        return r.json()["prefix_blocks"]

    def metric_lines(self, prefix: str) -> list[str]:
        text = httpx.get(f"{self.admin}/metrics", timeout=5).text
        return [m for m in text.splitlines() if m.startswith(prefix)]


def test_a_dead_server_loses_its_index_entries_within_a_scrape_interval():
    """Approximate mode learns a prefix from its decision; when the server stops answering
    its metrics, the picker forgets what it believed that server held (counted by reason)."""
    with Stack(StackOptions(upstreams=2, sim_args=())) as stack:
        taught = Taught(stack)
        held = taught.held
        assert max(held().values()) > 0
        stack.fleet.proc.kill()  # every simulated server dies at once
        stack.fleet.proc.wait()

        def invalidations() -> list[str]:
            return taught.metric_lines("extproc_endpoint_cache_inv")

        want = 'extproc_endpoint_cache_invalidations_total{reason="unreachable"} 2.0'
        start = time.monotonic()
        while time.monotonic() - start < 5 and (
            any(held().values()) or want not in invalidations()
        ):
            time.sleep(0.02)
        assert not any(held().values()), held()
        assert want in invalidations()


def test_a_frozen_server_keeps_its_index_entries_and_comes_back():
    """A server that stops answering in time (SIGSTOP: frozen, as a starved host looks) is
    taken out of routing after three timed-out scrapes, but what the index credits it with
    stays: the same process comes back with its cache, and its start time says so."""
    with Stack(StackOptions(upstreams=2, sim_args=())) as stack:
        taught = Taught(stack)
        held, metric_lines = taught.held, taught.metric_lines

        def failures() -> list[float]:
            return [float(m.split()[-1]) for m in metric_lines("extproc_endpoint_scrape_failures")]

        before = held()
        assert max(before.values()) > 0
        os.kill(stack.fleet.proc.pid, signal.SIGSTOP)  # every simulated server at once
        try:
            wait_until(
                lambda: len(f := failures()) == 2 and min(f) >= 4,
                timeout_s=20,
                what="three timed-out scrapes of each server",
            )
        finally:
            os.kill(stack.fleet.proc.pid, signal.SIGCONT)
        assert held() == before  # before any request could teach the index again
        assert taught.send() == 200
        unreachable = 'extproc_endpoint_cache_invalidations_total{reason="unreachable"}'
        assert [float(m.split()[-1]) for m in metric_lines(unreachable)] in ([], [0.0])
