"""A chat's next turn through Envoy and `extproc serve` while its home server runs a long
answer on the same system prompt: `kv-cache-utilization-scorer` with `countRequest: true`
scores the KV left once the turn is placed, so the blocks the home server uses for the
shared prompt (which the turn reuses there, and must write anew anywhere else) do not count
against it, and the turn stays home; counting only the KV used now (the default) sends it
to the empty server (issue 14, eleventh session: on a small cache the holder's used prefix
moved tenants off it).

The profile is the KV scorer with a light prefix scorer (prefix 0.3, KV 1), so the KV score
decides: with the used share u of the home server, the default moves the turn when 0.3 x
its held fraction < u; counting the request keeps it while that exceeds what the long
answer uses beyond the shared prompt. Deterministic: the long answer is streamed, its first
token read, and the picker's state polled until a scrape taken after that token is in it;
the next turn is then explained (never sent)."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import chat, text
from tests.e2e.chat_turns import ChatTurns
from tests.e2e.scraped import scrape_since

# A small cache (200 blocks of 16 tokens) and a slow decode: the long answer keeps its
# blocks (the shared prompt's) in use while the next turn is explained.
SIM = ("--decode-tps", "50", "--num-gpu-blocks", "200")
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"
KV = "default/kv-cache-utilization-scorer"


def config(count_request: bool) -> str:
    return PARSE + (
        "scheduling:\n"
        "  plugins:\n"
        "  - type: prefix-cache-scorer\n"
        "  - type: kv-cache-utilization-scorer\n"
        f"    parameters: {{countRequest: {str(count_request).lower()}}}\n"
        "  - type: max-score-picker\n"
        "  schedulingProfiles:\n"
        "  - name: default\n"
        "    plugins:\n"
        "    - {pluginRef: prefix-cache-scorer, weight: 0.3}\n"
        "    - {pluginRef: kv-cache-utilization-scorer, weight: 1}\n"
        "    - {pluginRef: max-score-picker}\n"
    )


@pytest.mark.parametrize("count_request", [False, True], ids=["used-now", "count-request"])
def test_the_home_servers_kv_for_the_shared_prompt_does_not_push_the_next_turn_off_it(
    tmp_path, count_request: bool
):
    rng = random.Random(11)
    system = "agent prompt. " + text(rng, 300)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(config(count_request))
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        admin = f"http://127.0.0.1:{stack.picker_admin_port}"
        turns = ChatTurns(http, stack)

        def state(address: str) -> dict:
            rows = http.get(f"{admin}/debug/state").json()["endpoints"]
            return next(row["state"] for row in rows if row["address"] == address)

        first = "question one. " + text(rng, 8)
        home = turns.send(chat(system, first))
        # The long answer on the same prompt, sent to the home server itself (where the
        # picker would send it is not this test's question): a hit there.
        long = chat(system, first, text(rng, 8), "go on. " + text(rng, 8), max_tokens=400,
                    stream=True)  # fmt: skip
        with http.stream("POST", f"http://{home}/v1/chat/completions", json=long) as s:
            assert s.status_code == 200, s.read()
            assert s.headers[SERVED_BY_HEADER] == home
            lines = (line for line in s.iter_lines() if line.startswith("data: "))
            next(lines)  # the role-only chunk
            next(lines)  # the first token: the request runs, its blocks in use
            # A scrape taken since the first token, the request still in flight.
            st = scrape_since(lambda: state(home), time.monotonic())
            # Most of the home server's cache is the shared prompt, in use by the answer.
            assert 0.45 < st["kv_usage"] < 0.95, st
            got = turns.explain(chat(system, "question two. " + text(rng, 8)))
            assert not s.is_closed  # still decoding
        other = next(a for a in got["scores"][KV] if a != home)
        kv = got["scores"][KV]
        if count_request:
            assert got["endpoints"][0] == home, json.dumps((got, st))
            # Left after the turn: about equal (the other server must write the prompt).
            assert abs(kv[home] - kv[other]) < 0.3, kv
        else:
            assert got["endpoints"][0] == other, json.dumps((got, st))
            assert kv[home] == pytest.approx(1.0 - st["kv_usage"], abs=0.05), kv
            assert kv[other] == 1.0, kv
