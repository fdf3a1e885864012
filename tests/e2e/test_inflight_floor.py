"""A chat's next turn through Envoy and `extproc serve` while its home server streams a long
answer: a request decoding there is not taken for queued prefill and the turn stays home.
By default (`inflightFloor: drained`, since issue 14's fifteenth session) predicted TTFT
takes no in-flight floor beyond its own virtual queue; with `inflightFloor:
untilFirstToken` the floor counts only the requests the engine reports before their first
token. Counted until it ended (`untilEnd`, the default before), a long answer's prompt made
the holder look seconds deep and sessions left the server holding their prefix (eighth
session; at the tenants knee, fourteenth and fifteenth): the test fails with it.

Deterministic: the long request is streamed, its first token read, and the picker's own
state polled until a scrape taken after that token is in it; the next turn is then
explained (never sent), reading the picker's choice and the scorer's scores."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.chat_bodies import chat, text
from tests.e2e.chat_turns import ChatTurns
from tests.e2e.profiles import default_profile_with
from tests.e2e.scraped import scrape_since
from tests.e2e.test_request_end import picker_metric

# Slow decode (the long answer lasts ~60 s unless cut), fast prefill: the answer's prompt
# is long to prefill than the next turn's whole prompt, which the old floor then counted.
SIM = ("--decode-tps", "50", "--num-gpu-blocks", "4000")
# Told, as calibration would find (a change of keys mid-test would forget every prefix).
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"
SCORER = "default/predicted-ttft-scorer"


@pytest.mark.parametrize("floor", ["default", "untilFirstToken"])
def test_a_request_decoding_on_the_home_server_does_not_push_the_next_turn_off_it(tmp_path, floor):
    rng = random.Random(7)
    system = "agent prompt. " + text(rng, 80)
    cfg = tmp_path / "picker.yaml"
    if floor == "default":  # no scheduling section: the profile users get
        cfg.write_text(PARSE)
    else:
        params = {"predicted-ttft-scorer": {"inflightFloor": floor}}
        cfg.write_text(PARSE + default_profile_with(params))
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        admin = f"http://127.0.0.1:{stack.picker_admin_port}"
        turns = ChatTurns(http, stack)
        send, explain = turns.send, turns.explain

        def queued(address: str) -> float:
            for line in http.get(f"{admin}/metrics").text.splitlines():
                if line.startswith("extproc_predicted_prefill_queue_seconds{") and (
                    f'endpoint="{address}"' in line
                ):
                    return float(line.rsplit(" ", 1)[1])
            return 0.0

        def state(address: str) -> dict:
            rows = http.get(f"{admin}/debug/state").json()["endpoints"]
            return next(row["state"] for row in rows if row["address"] == address)

        # Three sessions on one agent prompt, two servers: two sessions share a server.
        firsts = [f"session {i}. " + text(rng, 12) for i in range(3)]
        homes = [send(chat(system, q)) for q in firsts]
        # In-flight counts are held until the access log says a request ended once its
        # stream is open (request_end auto mode): the long answer below is then counted.
        wait_until(
            lambda: picker_metric(stack, "extproc_access_log_entries_total") >= 1,
            timeout_s=10,
            what="the first access-log entry",
        )
        mine = 2
        home = homes[mine]
        peer = next(i for i in range(2) if homes[i] == home)
        # The peer session's next turn: a long tool result and a long answer. It stays home
        # (its prompt is cached there) with ~3x the next turn's prompt uncached in flight.
        long = chat(system, firsts[peer], text(rng, 12), text(rng, 450), max_tokens=3000,
                    stream=True)  # fmt: skip
        with http.stream("POST", f"{stack.url}/v1/chat/completions", json=long) as s:
            assert s.status_code == 200
            assert s.headers[SERVED_BY_HEADER] == home
            # A chat stream opens with a role-only chunk; the next one holds the first token,
            # which the engine has counted by then.
            lines = (line for line in s.iter_lines() if line.startswith("data: "))
            next(lines)
            next(lines)
            # A scrape taken since the first token, the request still in flight.
            st = scrape_since(lambda: state(home), time.monotonic())
            assert st["inflight_requests"] == 1 and st["inflight_tokens"] > 1500, st
            # The picker's own virtual queue drains at its estimate of the prefill, which
            # may run past the engine's (token estimates differ): let it drain, so only
            # the in-flight floor is left to tell the servers apart.
            wait_until(lambda: queued(home) == 0.0, timeout_s=30, what="the virtual queue drained")
            got = explain(chat(system, firsts[mine], text(rng, 12), text(rng, 12)))
            assert not s.is_closed  # still decoding
        assert got["endpoints"][0] == home, json.dumps((got, st))
        assert got["scores"][SCORER][home] == 1.0, got
        # The counter of predictions that fell back to the whole floor is exported (it
        # may count a stale scrape's predictions on a loaded machine, so its value is not
        # asserted here; tests/scheduling/test_ttft.py does).
        metrics = http.get(f"{admin}/metrics").text
        assert "extproc_predicted_ttft_floor_fallbacks_total{" in metrics
