"""Three `extproc serve` replicas sharing one Redis behind one Envoy fold each other's
placements into `predicted-ttft-scorer` (`state.shared_placements`,
server/shared_placements.py): every replica counts the tokens the whole fleet wrote into each
server's cache, so a server the fleet filled is charged for the evictions a new prompt causes
there on every replica, though each replica placed only about a third of what filled it
(on main there is no view to compare; with `shared_placements: false` each replica counts its
own share: the views differ and a replica that placed a third of the turns still sees room
on the holder, scoring a new prompt 1.0 on both servers: the test fails there).

Deterministic: requests go one at a time through Envoy (round robin over the replicas);
predicted TTFT alone decides (every turn extending one shared prompt stays on its holder:
leaving recomputes the shared prompt, staying costs at most the suffix twice); the queues
have drained before the picker's explanation is read; the speeds are the sims' own, set to
the scorer's prior."""

from __future__ import annotations

import random
import time

import httpx

from extproc.sim import SERVED_BY_HEADER
from tests.e2e.profiles import profile_of
from tests.e2e.replicas import Replicas, replicas
from tests.redis_servers import RedisServer

# 64 blocks x 16 tokens: 1,024 tokens of cache per server. Prefill at the scorer's prior.
SIM = ("--num-gpu-blocks", "64", "--prefill-tps", "2000")
# Estimated tokens are bytes (as in tests/e2e/test_spill_eviction.py).
TTFT = "predicted-ttft-scorer"
PICKER = """
parse: {block_tokens: 16, bytes_per_token: 1}
state: {shared_placements: %s}
""" + profile_of({TTFT: 1}, {TTFT: {"priorPrefillTokensPerSecond": 2000}})
SCORER = "default/predicted-ttft-scorer"
CAPACITY = 64 * 16
WORDS = ("tenant", "policy", "invoice", "refund", "order", "ticket", "account", "shipping")
TURNS = 6


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(system: str, user: str) -> dict:
    return {
        "model": "tiny", "max_tokens": 2,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
    }  # fmt: skip


def written(metrics: str) -> dict[str, float]:
    out = {}
    for line in metrics.splitlines():
        if line.startswith("extproc_predicted_written_tokens{"):
            label, value = line.rsplit(" ", 1)
            out[label.split('endpoint="')[1].split('"')[0]] = float(value)
    return out


def alike(a: dict[str, float], b: dict[str, float]) -> bool:
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 1e-6 * max(1.0, b[k]) for k in a)


def settled(http: httpx.Client, admin: list[int]) -> None:
    """Every request so far has ended in every replica's books (the access log's entry comes
    after the response): no in-flight prefill left to count as a queue on the holder."""
    for _ in range(200):
        texts = [http.get(f"http://127.0.0.1:{p}/metrics").text for p in admin]
        if not any(
            float(line.rsplit(" ", 1)[1])
            for t in texts for line in t.splitlines()
            if line.startswith("extproc_inflight_requests{")
        ):  # fmt: skip
            return
        time.sleep(0.05)
    raise AssertionError("requests still in flight")


def place_turns(fleet: Replicas, rng: random.Random) -> list[str]:
    """`TURNS` requests on one ~300-byte shared prompt, each with ~200 new bytes, each let
    end in every replica's books before the next: the servers they were placed on."""
    system = "shared agent prompt. " + text(rng, 38)
    served = []
    for _ in range(TURNS):
        r = fleet.http.post(
            f"{fleet.stack.url}/v1/chat/completions", json=chat(system, text(rng, 28))
        )
        assert r.status_code == 200, r.text
        served.append(r.headers[SERVED_BY_HEADER])
        settled(fleet.http, fleet.admin)
    return served


def explain_everywhere(fleet: Replicas, probe: dict) -> list[dict]:
    """Every replica's explanation of `probe` (each scores it, as a request would)."""
    path = {"x-extproc-path": "/v1/chat/completions"}
    explained = []
    for p in fleet.admin:
        r = fleet.http.post(f"http://127.0.0.1:{p}/debug/explain", json=probe, headers=path)
        assert r.status_code == 200, r.text
        explained.append(r.json())
    return explained


def sample(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def run(tmp_path, redis: RedisServer, share: bool):
    """Six turns extending one ~300-byte prompt by ~200 new bytes each, then every replica's
    view and its explanation of a new ~200-byte prompt."""
    rng = random.Random(3)
    with replicas(tmp_path, redis, PICKER % ("true" if share else "false"), sim_args=SIM) as fleet:
        served = place_turns(fleet, rng)
        deadline = time.monotonic() + 15
        while True:
            texts = fleet.metrics_text()
            views = [written(t) for t in texts]
            if all(alike(v, views[0]) for v in views) or time.monotonic() > deadline or not share:
                break
            time.sleep(0.2)
        time.sleep(0.5)  # every virtual queue drained (one turn's ~0.25 s of prefill at most)
        probe = chat("a new tenant. " + text(rng, 12), text(rng, 16))
        explained = explain_everywhere(fleet, probe)
    return served, texts, views, explained


def test_every_replica_charges_the_server_the_fleet_filled(tmp_path, redis_server):
    served, texts, views, explained = run(tmp_path, redis_server, share=True)
    why = (served, views, [e["scores"][SCORER] for e in explained])
    home = served[0]
    assert served == [home] * TURNS, why  # each turn stayed where the shared prompt is
    decisions = [sample(t, "extproc_decisions_total") for t in texts]
    assert sum(1 for d in decisions if d > 0) >= 2, (decisions, why)  # several replicas placed
    # Every replica counts every placement: the fleet filled the holder's cache.
    assert all(alike(v, views[0]) for v in views), why
    assert views[0][home] > CAPACITY, why
    # So on every replica a new prompt is charged the evictions it would cause there, and
    # not on the other server, whose cache is empty.
    for e in explained:
        scores = e["scores"][SCORER]
        other = next(a for a in scores if a != home)
        # (The measured reuse is still small after six placements: a modest charge.)
        assert scores[other] == 1.0 and scores[home] < 0.97, why
    for t in texts:
        assert sample(t, "extproc_shared_placements_applied_total") > 0, why
        assert sample(t, "extproc_shared_placements_degraded") == 0, why
        assert sample(t, "extproc_shared_placements_bad_entries_total") == 0, why
