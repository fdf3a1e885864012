"""Precise mode through `extproc serve` behind Envoy: an engine that empties its prefix cache
(`POST /reset_prefix_cache`, published as a KV-event AllBlocksCleared) is no longer counted
full by `predicted-ttft-scorer`. Before the fix the index forgot the endpoint's blocks but the
scorer kept the tokens written there, and a new prompt was charged the eviction cost of a
full cache on a server holding nothing (bench_routing's rate steps emptied the caches this
way before the twenty-fifth session).

The scenario is tests/e2e/test_replica_placements.py's on one picker: one shared prompt
extended turn by turn, one request at a time, predicted TTFT alone deciding, so every turn
stays on the server holding the prompt and the tokens written there pass its 1,024-token
cache; then that server's cache is emptied."""

from __future__ import annotations

import random
import time

import httpx
import yaml

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import SimFleet, Stack, StackOptions
from tests.e2e.profiles import profile_of
from tests.e2e.test_replica_placements import CAPACITY, SCORER, SIM, chat, text, written

TTFT = "predicted-ttft-scorer"
TURNS = 6
CLEARS = "extproc_kv_events_clears_total"


def sample(metrics: str, name: str) -> float:
    line = next(x for x in metrics.splitlines() if x.startswith(name + " "))
    return float(line.split()[1])


def explain(http: httpx.Client, admin: str, probe: dict) -> dict:
    r = http.post(
        f"{admin}/debug/explain", json=probe, headers={"x-extproc-path": "/v1/chat/completions"}
    )
    assert r.status_code == 200, r.text
    return r.json()


def test_a_cleared_cache_is_not_charged_as_full(tmp_path):
    rng = random.Random(5)
    with SimFleet(2, SIM, log_dir=tmp_path) as fleet:
        cfg = fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}")
        cfg.update(
            yaml.safe_load(profile_of({TTFT: 1}, {TTFT: {"priorPrefillTokensPerSecond": 2000}}))
        )
        path = tmp_path / "picker.yaml"
        path.write_text(yaml.safe_dump(cfg))
        opts = StackOptions(fleet=fleet, log_dir=tmp_path, extproc_args=("--config", str(path)))
        with Stack(opts) as stack, httpx.Client(timeout=30) as http:
            time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's socket
            admin = f"http://127.0.0.1:{stack.picker_admin_port}"
            system = "shared agent prompt. " + text(rng, 38)
            served = []
            for _ in range(TURNS):
                r = http.post(f"{stack.url}/v1/chat/completions", json=chat(system, text(rng, 28)))
                assert r.status_code == 200, r.text
                served.append(r.headers[SERVED_BY_HEADER])
            time.sleep(0.5)  # the queues drained (a turn's prefill is ~0.2 s)
            home = served[0]
            probe = chat("a new tenant. " + text(rng, 12), text(rng, 16))
            before = explain(http, admin, probe)
            full = written(http.get(f"{admin}/metrics").text)
            # A sim is named by its address (the header), as the picker names it.
            http.post(f"http://{home}/reset_prefix_cache").raise_for_status()
            deadline = time.monotonic() + 5
            while sample(metrics := http.get(f"{admin}/metrics").text, CLEARS) < 1:
                assert time.monotonic() < deadline, "no AllBlocksCleared reached the picker"
                time.sleep(0.05)
            after = explain(http, admin, probe)
    why = (served, full, before["terms"][SCORER], after["terms"][SCORER])
    assert served == [home] * TURNS, why  # every turn stayed on the prompt's holder
    assert full[home] > CAPACITY, why  # its cache counted full
    assert before["terms"][SCORER][home]["eviction_s"] > 0, why
    # Emptied: nothing counted written there, no eviction charged.
    assert written(metrics).get(home, 0.0) == 0.0, (written(metrics), why)
    assert after["terms"][SCORER][home]["eviction_s"] == 0.0, why
