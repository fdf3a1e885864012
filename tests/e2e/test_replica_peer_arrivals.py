"""Three `extproc serve` replicas behind one Envoy on one redis-server count every request
the others placed, exactly, through the in-flight exchange's placement counters
(endpoints/shared_inflight.py): the exchange runs once a second here, and each short request
starts and ends between two exchanges, so the peers' in-flight totals hardly ever show it
(their growth, the dating before the counters, is checked to have missed some: the test
fails there). Each replica's own placements are checked against its decisions counter,
and every replica's count of its peers' requests and prompt tokens against the sum of
theirs.

Deterministic: requests go one at a time through Envoy (round robin over the replicas),
each after the previous ended in every replica's books.

Then every replica forgets the counters of the servers it has been idle on
(`counters_idle_s`, 3 s here), without a peer reading that as counters going back, and the
next requests are still counted exactly."""

from __future__ import annotations

import random

from extproc.stack import wait_until
from tests.e2e.chat_bodies import chat, text
from tests.e2e.replicas import replicas
from tests.redis_servers import RedisServer

# The exchange alone (`push: false`): pushed placements reach the peers at once, but their
# ends only at the next exchange, so every request here would wait a second or two to end in
# every replica's books (35 s against 16 s); tests/endpoints/test_inflight_push.py checks
# that a push and the exchange count a placement once.
PICKER = """
parse: {block_tokens: 16, bytes_per_token: 1}
state: {shared_inflight: {interval_s: 1.0, counters_idle_s: 3.0, push: false}}
"""
REQUESTS, AFTER_PRUNING = 12, 4


def test_replicas_count_their_peers_placements_exactly(tmp_path, redis_server: RedisServer):
    rng = random.Random(14)
    with replicas(tmp_path, redis_server, PICKER) as fleet:
        http, stack = fleet.http, fleet.stack

        def read(name: str) -> list[float]:
            return fleet.metric(f"extproc_{name}", present=True)

        wait_until(
            lambda: read("shared_inflight_peers") == [2, 2, 2],
            timeout_s=15,
            what="every replica sees the other two (idle, through their counters)",
        )

        def send(n: int) -> None:
            for _ in range(n):
                body = chat("a short tenant prompt. " + text(rng, 20), text(rng, 10))
                r = http.post(f"{stack.url}/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                wait_until(
                    lambda: fleet.metric("extproc_inflight_requests") == [0, 0, 0],
                    timeout_s=15,
                    what="the request ended in every replica's books",
                )

        def counted_exactly(requests: int) -> list[float]:
            """Each replica's count of its peers' requests and tokens is the others' sum."""
            placed, tokens = (
                read("shared_inflight_placed_total"),
                read("shared_inflight_placed_tokens_total"),
            )
            assert placed == read("decisions_total"), placed
            assert sum(placed) == requests and sum(1 for n in placed if n) >= 2, placed
            peers = [sum(placed) - n for n in placed]
            peer_tokens = [sum(tokens) - t for t in tokens]
            got: list[list[float]] = []

            def counted() -> bool:
                got[:] = [read("shared_inflight_peer_arrivals_total"),
                          read("shared_inflight_peer_arrived_tokens_total")]  # fmt: skip
                return got == [peers, peer_tokens]

            wait_until(counted, timeout_s=10, what=f"every replica counts {peers}, {peer_tokens}")
            return tokens

        send(REQUESTS)
        tokens = counted_exactly(REQUESTS)
        peer_tokens = [sum(tokens) - t for t in tokens]
        growth = read("shared_inflight_peer_growth_tokens_total")
        assert all(g < t for g, t in zip(growth, peer_tokens, strict=True)), (growth, tokens)
        assert read("shared_inflight_counter_resets_total") == [0, 0, 0]
        assert read("shared_inflight_legacy_peers") == [0, 0, 0]
        assert read("shared_inflight_bad_entries_total") == [0, 0, 0]
        # Idle: every replica that placed forgets its servers' counters; no peer reads a
        # reset, and the next placements (counters from zero) are counted as exactly.
        wait_until(
            lambda: all(
                pruned >= 1 or placed == 0
                for pruned, placed in zip(
                    read("shared_inflight_counters_pruned_total"),
                    read("shared_inflight_placed_total"),
                    strict=True,
                )
            ),
            timeout_s=15,
            what="idle servers' counters pruned",
        )
        send(AFTER_PRUNING)
        counted_exactly(REQUESTS + AFTER_PRUNING)
        assert read("shared_inflight_counter_resets_total") == [0, 0, 0]
