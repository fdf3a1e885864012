"""Three `extproc serve` replicas behind one Envoy on one redis-server count every request
the others placed, exactly, through the in-flight exchange's placement counters
(endpoints/shared_inflight.py): the exchange runs once a second here, and each short request
starts and ends between two exchanges, so the peers' in-flight totals hardly ever show it
(their growth, the dating before the counters, is checked to have missed some: the test
fails there). Each replica's own placements are checked against its decisions counter,
and every replica's count of its peers' requests and prompt tokens against the sum of
theirs.

Deterministic: requests go one at a time through Envoy (round robin over the replicas),
each after the previous ended in every replica's books."""

from __future__ import annotations

import random

import httpx

from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.chat_bodies import chat, text
from tests.e2e.flow_configs import metric_sum
from tests.redis_servers import RedisServer

PICKER = """
parse: {block_tokens: 16, bytes_per_token: 1}
state: {shared_inflight: {interval_s: 1.0}}
"""
REQUESTS = 12


def test_replicas_count_their_peers_placements_exactly(tmp_path, redis_server: RedisServer):
    rng = random.Random(14)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PICKER)
    opts = StackOptions(
        upstreams=2, replicas=3, redis_url=redis_server.url, extproc_args=("--config", str(cfg))
    )
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        admin = [stack.picker_admin_port] + [a for _, _, a in stack.replica_ports]

        def read(name: str) -> list[float]:
            pattern = rf"^extproc_{name}(?:_total)?(?:{{[^}}]*}})? (\S+)$"
            return [metric_sum(stack, pattern, admin_port=p) for p in admin]

        wait_until(
            lambda: read("shared_inflight_peers") == [2, 2, 2],
            timeout_s=15,
            what="every replica sees the other two (idle, through their counters)",
        )
        for _ in range(REQUESTS):
            body = chat("a short tenant prompt. " + text(rng, 20), text(rng, 10))
            r = http.post(f"{stack.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            wait_until(
                lambda: sum(metric_sum(stack, r"^extproc_inflight_requests{[^}]*} (\S+)$",
                                       present=False, admin_port=p) for p in admin) == 0,
                timeout_s=15,
                what="the request ended in every replica's books",
            )  # fmt: skip
        placed, tokens = read("shared_inflight_placed"), read("shared_inflight_placed_tokens")
        assert placed == read("decisions"), placed
        assert sum(placed) == REQUESTS and sum(1 for n in placed if n) >= 2, placed
        peers = [sum(placed) - n for n in placed]
        peer_tokens = [sum(tokens) - t for t in tokens]
        got: list[list[float]] = []

        def counted() -> bool:
            got[:] = [read("shared_inflight_peer_arrivals"),
                      read("shared_inflight_peer_arrived_tokens")]  # fmt: skip
            return got == [peers, peer_tokens]

        wait_until(counted, timeout_s=10, what=f"every replica counts {peers}, {peer_tokens}")
        growth = read("shared_inflight_peer_growth_tokens")
        assert all(g < t for g, t in zip(growth, peer_tokens, strict=True)), (growth, tokens)
        assert read("shared_inflight_counter_resets") == [0, 0, 0]
        assert read("shared_inflight_legacy_peers") == [0, 0, 0]
        assert read("shared_inflight_bad_entries") == [0, 0, 0]
