"""Three `extproc serve` replicas behind one Envoy on one redis-server: a tenant's holder is
busy streaming a long answer another replica placed there; its prompt was prefilled long
ago. With `predicted-ttft-scorer`'s `peerInflight: drained` every replica that did not place
it counts the peer's in-flight tokens only as far as a prefill lane could not have computed
them since they arrived, so the tenant's next request stays on its holder (issue 14, tenth
session: counted until the answer ends, they made the holder look a second deep and moved
tenants to a cold server; `whole`, the default until then, still does, and the test checks
it). `drained` is the default since the second part of that session. The
replica that placed the answer counts its own in-flight tokens whole either way, as one
replica does. `peerInflight` shapes the floor `inflightFloor: untilEnd` takes, so those
cases ask for it by name: under `inflightFloor: drained`, the default since the fifteenth
session, no replica takes an in-flight floor (the third test).

Deterministic: requests go one at a time through Envoy; the tenant's next request is only
explained (never sent) by each replica's admin port, after every replica counts the long
answer in flight, a lane at the sims' speed would have computed its prompt twice over, and
every virtual queue drained. Predicted TTFT and kv-cache utilization at the default weights
decide (no session filters: the long answer is a later turn, the probe a new one). Prefill
at the scorer's prior; estimated tokens are bytes.

`peerInflight: sharedLane` (opt-in, eleventh session): on one server, a replica's own long
prompt (A) and a peer's short one (B) placed after it; the replica that placed A drains B
only in a lane that has computed A first, `drained` in a lane of B's own."""

from __future__ import annotations

import contextlib
import random
import threading
import time

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import wait_until
from tests.e2e.chat_bodies import chat, text
from tests.e2e.replicas import replicas
from tests.e2e.sim_speed import finish_fast
from tests.redis_servers import RedisServer

# Slow decode: the long answer streams for a minute unless cut. Prefill at 2,000 tokens/s.
SIM = ("--decode-tps", "50", "--prefill-tps", "2000", "--num-gpu-blocks", "4000")
# The lookup budget: on a loaded 2-core machine a Redis round trip often takes longer than
# the 5 ms default, and a lookup answered degraded (no prefix matches) sent the long answer
# to the cold server, or tied the probe's holder with it (about one run in five with other
# tests beside; the index's degradation has tests of its own). As test_replica_sessions.py.
PICKER = """
parse: {block_tokens: 16, bytes_per_token: 1}
index: {lookup_budget_s: 0.1}
state: {request_end: {mode: access-log}}
scheduling:
  plugins:
  - type: predicted-ttft-scorer
    parameters: {priorPrefillTokensPerSecond: 2000, %s}
  - {type: kv-cache-utilization-scorer}
  - {type: max-score-picker}
  schedulingProfiles:
  - name: default
    plugins:
    - {pluginRef: predicted-ttft-scorer, weight: 4}
    - {pluginRef: kv-cache-utilization-scorer, weight: 1}
    - {pluginRef: max-score-picker}
"""
SCORER = "default/predicted-ttft-scorer"
CHAT = "/v1/chat/completions"


def run(
    tmp_path, redis: RedisServer, floor: str
) -> tuple[str, int, list[dict], list[float], list[float]]:
    """The holder, which replica placed the long answer, every replica's explanation of the
    tenant's next request, every replica's drained-tokens counter and mean placed prefill."""
    rng = random.Random(11)
    with replicas(tmp_path, redis, PICKER % floor, sim_args=SIM) as fleet:
        stack, http, admin = fleet.stack, fleet.http, fleet.admin
        system = "tenant prompt. " + text(rng, 150)  # ~1,000 tokens: 0.5 s to recompute
        first = text(rng, 12)
        r = http.post(f"{stack.url}{CHAT}", json=chat(system, first))
        assert r.status_code == 200, r.text
        home = r.headers[SERVED_BY_HEADER]
        wait_until(
            lambda: fleet.metric("extproc_inflight_requests") == [0, 0, 0],
            timeout_s=15,
            what="the first request ended in every replica's books",
        )
        before = fleet.metric("extproc_decisions_total")
        # The tenant's conversation goes on: ~2,100 new prompt tokens (1 s of prefill) and
        # a long answer, on the holder (its prompt is cached there).
        long = chat(system, first, text(rng, 12), text(rng, 300), max_tokens=3000, stream=True)
        with http.stream("POST", f"{stack.url}{CHAT}", json=long) as s:
            assert s.status_code == 200
            degraded = fleet.metric("extproc_index_lookups_degraded_total")
            assert s.headers[SERVED_BY_HEADER] == home, degraded
            lines = (line for line in s.iter_lines() if line.startswith("data: "))
            next(lines)
            next(lines)  # the first token: the prompt is prefilled
            grew = [
                n - b for n, b in zip(fleet.metric("extproc_decisions_total"), before, strict=True)
            ]
            assert sorted(grew) == [0, 0, 1], grew
            placer = grew.index(1)
            wait_until(
                lambda: all(n > 1500 for n in fleet.metric("extproc_inflight_tokens", home)),
                timeout_s=15,
                what="every replica counts the long answer in flight",
            )
            time.sleep(2.5)  # a lane at 2,000 tokens/s computes its prompt twice over
            wait_until(
                lambda: fleet.metric("extproc_predicted_prefill_queue_seconds", home) == [0, 0, 0],
                timeout_s=15,
                what="every virtual queue drained",
            )
            probe = chat(system, text(rng, 12))  # the tenant's next conversation
            explained = []
            for p in admin:
                e = http.post(
                    f"http://127.0.0.1:{p}/debug/explain",
                    json=probe,
                    headers={"x-extproc-path": CHAT},
                )
                assert e.status_code == 200, e.text
                explained.append(e.json())
            assert fleet.metric("extproc_inflight_tokens", home)[placer] > 1500
            assert not s.is_closed  # still decoding
            drained = fleet.metric("extproc_predicted_ttft_peer_tokens_drained_total")
            means = fleet.metric("extproc_predicted_mean_prefill_tokens")
    return home, placer, explained, drained, means


# `peerInflight` shapes the in-flight floor that `inflightFloor: untilEnd` takes (the default
# before the fifteenth session; `drained`, the default now, has none, tested below): its
# default (given alone), `drained` spelled out, and `sharedLane` (the replicas that did not
# place the answer have nothing of their own there).
UNTIL_END = "inflightFloor: untilEnd"


@pytest.mark.parametrize(
    "params",
    [UNTIL_END, f"{UNTIL_END}, peerInflight: drained", f"{UNTIL_END}, peerInflight: sharedLane"],
    ids=["untilEnd", "drained", "sharedLane"],
)
def test_replicas_keep_a_tenant_on_its_holder_while_a_peers_answer_decodes_there(
    tmp_path, redis_server, params
):
    home, placer, explained, drained, _ = run(tmp_path, redis_server, params)
    how = [(e["endpoints"], e["scores"][SCORER], e["index_degraded"]) for e in explained]
    why = (home, placer, how, drained)
    for i, e in enumerate(explained):
        if i == placer:
            # Its own answer counts whole, as on one replica: the holder looks a second deep.
            assert e["endpoints"][0] != home, why
            assert drained[i] == 0, why
        else:
            assert e["endpoints"][0] == home, why
            assert e["scores"][SCORER][home] == 1.0, why
            assert drained[i] > 1500, why
            # Counted once: the probe's scoring, not again for its explanation.
            assert drained[i] <= e["terms"][SCORER][home]["peer_inflight_tokens"], why


def test_counted_whole_a_peers_answer_moves_the_tenant_to_a_cold_server(tmp_path, redis_server):
    home, placer, explained, drained, _ = run(
        tmp_path, redis_server, f"{UNTIL_END}, peerInflight: whole"
    )
    why = (home, placer, [(e["endpoints"], e["scores"][SCORER]) for e in explained], drained)
    assert all(e["endpoints"][0] != home for e in explained), why
    assert drained == [0, 0, 0], why


def test_with_the_drained_floor_the_placer_keeps_the_tenant_on_its_holder_too(
    tmp_path, redis_server
):
    # `inflightFloor: drained` (the default): no replica floors by in-flight tokens; its own
    # placements are its virtual queue (drained by now), the peers' count as far as not
    # computed.
    home, placer, explained, _, means = run(tmp_path, redis_server, "inflightFloor: drained")
    why = (home, placer, [(e["endpoints"], e["scores"][SCORER]) for e in explained], means)
    assert all(e["endpoints"][0] == home for e in explained), why
    assert all(e["scores"][SCORER][home] == 1.0 for e in explained), why
    # `meanPlacements: fleet` (the default): the two requests were placed by one or two
    # replicas, yet every replica's mean placed prefill averages them (the peers' from the
    # exchange); with `own` a replica that placed neither would have none.
    assert all(m > 0 for m in means), why


# Prefill slow enough that no first token (and no measured speed) comes before the probe.
SLOW_PREFILL = (
    *("--decode-tps", "50", "--prefill-tps", "500"),
    *("--num-gpu-blocks", "4000", "--max-model-len", "32768"),
)


def _stream_in_background(http: httpx.Client, url: str, body: dict) -> threading.Thread:
    """Sends `body` streamed and reads it to its end (or the stack's) in a daemon thread."""

    def read() -> None:
        with contextlib.suppress(httpx.HTTPError), http.stream("POST", url, json=body) as s:
            for _ in s.iter_lines():
                pass

    t = threading.Thread(target=read, daemon=True)
    t.start()
    return t


def run_lane(tmp_path, redis: RedisServer, mode: str) -> tuple[int, int, list[float], list[dict]]:
    """One server; a long prompt's answer (A) placed by one replica, then a short one's (B)
    by the next. Returns A's placer, B's placer, every replica's drained-tokens counter after
    explaining a probe, and every replica's terms for the server."""
    rng = random.Random(12)
    picker = PICKER % f"{UNTIL_END}, peerInflight: {mode}"
    with replicas(
        tmp_path, redis, picker, upstreams=1, sim_args=SLOW_PREFILL, timeout_s=120
    ) as fleet:
        stack, http, admin = fleet.stack, fleet.http, fleet.admin
        url = f"{stack.url}{CHAT}"

        def placed_by(body: dict) -> int:
            before = fleet.metric("extproc_decisions_total")
            _stream_in_background(http, url, body)
            grew: list[float] = []

            def one_grew() -> bool:
                now = fleet.metric("extproc_decisions_total")
                grew[:] = [n - b for n, b in zip(now, before, strict=True)]
                return sum(grew) >= 1

            wait_until(one_grew, timeout_s=15, what="a replica placed the request")
            assert sorted(grew) == [0, 0, 1], grew
            return grew.index(1)

        # A: ~20,000 tokens (bytes), 10 s for a lane at the prior speed; B: ~400, 0.2 s.
        a = placed_by(chat(text(rng, 2700), text(rng, 5), max_tokens=1000, stream=True))
        home = stack.upstream_addresses[0]
        only_a = fleet.metric("extproc_inflight_tokens", home)[a]
        b = placed_by(chat(text(rng, 50), text(rng, 5), max_tokens=1000, stream=True))
        wait_until(
            lambda: all(n > only_a for n in fleet.metric("extproc_inflight_tokens", home)),
            timeout_s=15,
            what="every replica counts both answers in flight",
        )
        time.sleep(1.0)  # a lane for B alone has computed it; one behind A has not
        terms = []
        for p in admin:
            e = http.post(
                f"http://127.0.0.1:{p}/debug/explain",
                json=chat(text(rng, 30)),
                headers={"x-extproc-path": CHAT},
            )
            assert e.status_code == 200, e.text
            terms.append(e.json()["terms"][SCORER][home])
        drained = fleet.metric("extproc_predicted_ttft_peer_tokens_drained_total")
        # A's prefill alone has ~35 s to run, which the stack's stop would wait out (10 s,
        # then a kill): both answers end now instead.
        finish_fast(stack.fleet)
    return a, b, drained, terms


@pytest.mark.parametrize("mode", ["drained", "sharedLane"])
def test_shared_lane_drains_a_peers_answer_behind_the_replicas_own(tmp_path, redis_server, mode):
    # The replica that placed A sees B, a peer's, arrive behind its own A on the one server.
    # `drained` drains B in a lane of its own (its 1 s since is five times B's prefill);
    # `sharedLane` leaves B ahead while the lane is still computing A (10 s of it). The
    # third replica, with nothing of its own there, drains alike in both.
    a, b, drained, terms = run_lane(tmp_path, redis_server, mode)
    c = ({0, 1, 2} - {a, b}).pop()
    why = (a, b, drained, terms)
    assert terms[a]["tps"] < 5000, why  # the lane is still on A (20,000 tokens) in either mode
    if mode == "drained":
        assert drained[a] > 200, why
    else:
        assert drained[a] == 0, why
        # A counted whole (its own) and B not drained: every in-flight token is ahead.
        floor = terms[a]["inflight_floor_s"] * terms[a]["tps"]
        assert floor == pytest.approx(terms[a]["inflight_tokens"]), why
    assert drained[c] > 1000, why
