"""New agentic sessions on one shared agent prompt, through Envoy and `extproc serve` with
the default profile: 8 sessions on 4 servers start 2 per server. The bounded-sessions
bound, rounded up, let the servers already holding the prompt take a second and a third
session while the fourth server had none (issue 14: one server of four idle at the start,
spreads like 34/30/25/7 requests in every mode); recomputing the ~3,000-token prompt once
on that server costs far less than the sessions' tails crowding the others.

Sessions start one after another (each first turn answered before the next is sent), so
the placements do not depend on the machine's speed: only the bound decides."""

from __future__ import annotations

import random
from collections import Counter

import httpx

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions

SIM = ("--fast", "4", "--prefill-tps", "5000", "--num-gpu-blocks", "2000")
# Told, as calibration would find: a change of keys mid-test would forget every prefix.
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"
WORDS = ("plan", "tool", "search", "read", "file", "patch", "test", "result", "error", "diff")
SERVERS = 4
SESSIONS = 8


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_new_sessions_fill_every_server_before_any_takes_a_second(tmp_path):
    rng = random.Random(3)
    agent = "You are a coding agent. " + text(rng, 600)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=SERVERS, sim_args=SIM, extproc_args=("--config", str(cfg)))
    served: list[str] = []
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        for s in range(SESSIONS):
            # Each session's task is many blocks long: its tail is its own, not the prompt's.
            task = f"task {s}: " + text(rng, 80)
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [
                    {"role": "system", "content": agent},
                    {"role": "user", "content": task},
                ],
            }
            r = http.post(f"{stack.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            served.append(r.headers[SERVED_BY_HEADER])
    counts = Counter(served)
    # The first four sessions take one server each, then every server takes a second.
    assert len(set(served[:SERVERS])) == SERVERS, served
    assert sorted(counts.values()) == [SESSIONS // SERVERS] * SERVERS, served
