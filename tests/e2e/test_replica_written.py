"""Three `extproc serve` replicas sharing one Redis behind one Envoy, placements not folded
(`state.shared_placements` off, the default): with `predicted-ttft-scorer`'s
`writtenPlacements: fleet` every replica counts the tokens its peers placed on a server (from
the shared in-flight exchange) as written into that server's cache, so a server the fleet
filled is charged for the evictions a new prompt causes there on every replica, as one replica
placing everything charges it. With `own` each replica counts the third it placed: the views
differ, and a replica that placed little still sees room on the holder (the test fails there;
issue 14, twenty-fourth session: at multimodal 16 req/s one replica charged the eviction cost
in every decision, each of three replicas in a third of them).

The scenario is tests/e2e/test_replica_placements.py's (its helpers reused): one shared
prompt extended turn by turn, one request at a time through Envoy (round robin over the
replicas); predicted TTFT alone decides; the queues have drained before the explanations are
read; the speeds are the sims' own, set to the scorer's prior."""

from __future__ import annotations

import random
import time

from tests.e2e.profiles import profile_of
from tests.e2e.replicas import replicas
from tests.e2e.test_replica_placements import (
    CAPACITY,
    SCORER,
    SIM,
    TURNS,
    chat,
    explain_everywhere,
    place_turns,
    sample,
    text,
    written,
)

TTFT = "predicted-ttft-scorer"
PICKER = "parse: {block_tokens: 16, bytes_per_token: 1}\n" + profile_of(
    {TTFT: 1}, {TTFT: {"priorPrefillTokensPerSecond": 2000, "writtenPlacements": "fleet"}}
)
POOLED = "extproc_predicted_ttft_written_pooled_tokens_total"


def near(a: dict[str, float], b: dict[str, float]) -> bool:
    """The same servers, counts within 5%: a replica's own placements count the scorer's
    uncached estimate, the peers' the router's (whole blocks matched), a partial block apart."""
    return a.keys() == b.keys() and all(abs(a[k] - b[k]) <= 0.05 * max(1.0, b[k]) for k in a)


def test_every_replica_counts_the_peers_placements_as_written(tmp_path, redis_server):
    rng = random.Random(3)
    with replicas(tmp_path, redis_server, PICKER, sim_args=SIM) as fleet:
        served = place_turns(fleet, rng)
        time.sleep(0.5)  # every virtual queue drained (one turn's ~0.25 s of prefill at most)
        probe = chat("a new tenant. " + text(rng, 12), text(rng, 16))
        deadline = time.monotonic() + 10
        while True:
            # A replica pools what its peers placed on a server when it scores that server:
            # each explanation scores the probe, as a request would.
            explained = explain_everywhere(fleet, probe)
            texts = fleet.metrics_text()
            views = [written(t) for t in texts]
            if all(near(v, views[0]) for v in views) or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        pooled = fleet.metric(POOLED)
    why = (served, views, [e["scores"][SCORER] for e in explained])
    home = served[0]
    assert served == [home] * TURNS, why  # each turn stayed where the shared prompt is
    decisions = [sample(t, "extproc_decisions_total") for t in texts]
    assert sum(1 for d in decisions if d > 0) >= 2, (decisions, why)  # several replicas placed
    # Every replica counts every placement: the fleet filled the holder's cache.
    assert all(near(v, views[0]) for v in views), why
    assert views[0][home] > CAPACITY, why
    # The peers' share came from the exchange on every replica (none placed every turn).
    assert all(n > 0 for n in pooled), (pooled, why)
    assert all(sample(t, "extproc_shared_inflight_degraded") == 0 for t in texts), why
    # So on every replica a new prompt is charged the evictions it would cause on the holder,
    # and not on the other server, whose cache is empty.
    for e in explained:
        scores = e["scores"][SCORER]
        other = next(a for a in scores if a != home)
        # (The reuse share is each replica's own, from the two turns or so it placed: a
        # modest charge, 3-6% of the score here.)
        assert scores[other] == 1.0 and scores[home] < 1.0, why
        assert e["terms"][SCORER][home]["eviction_s"] > 0, why
