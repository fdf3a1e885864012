"""A model server restarts under live agent sessions, through Envoy and `extproc serve` with
the default profile: the restarted server carries none of the sessions homed there before,
so the next new session goes to it (their tails went with its cache). Counted with them,
it was as full as the other server, and the new session went to the server holding the
agent prompt, where every later one would pile up as the sessions' old ones regrow.

Sessions run one after another (each turn answered before the next is sent), so the
placements do not depend on the machine's speed; the restart is the simulator's
(`POST /sim/restart`: an emptied cache and a new process start time, what the scraper
reads as a restart)."""

from __future__ import annotations

import random

import httpx

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.test_session_spread import PARSE, SIM, text


def test_a_restarted_server_takes_the_next_session_its_old_ones_do_not_count(tmp_path):
    rng = random.Random(11)
    agent = "You are a coding agent. " + text(rng, 600)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        admin = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"

        def metric(name: str) -> float:
            lines = http.get(admin).text.splitlines()
            return next((float(m.rsplit(" ", 1)[1]) for m in lines if m.startswith(name)), 0.0)

        histories: list[list[dict[str, str]]] = []

        def turn(s: int, content: str) -> str:
            """Session `s`'s next turn (a new session when `s` is new); where it went."""
            if s == len(histories):
                histories.append([{"role": "system", "content": agent}])
            else:
                histories[s].append({"role": "assistant", "content": f"ran step {s}"})
            histories[s].append({"role": "user", "content": content})
            body = {"model": "tiny", "max_tokens": 2, "messages": histories[s]}
            r = http.post(f"{stack.url}/v1/chat/completions", json=body)
            assert r.status_code == 200, r.text
            return r.headers[SERVED_BY_HEADER]

        # Two agent sessions whose second turns add a tool result over half the prompt's
        # length: sessions on this prompt grow, so new ones are bounded, one per server.
        homes = []
        for s in range(2):
            homes.append(turn(s, f"task {s}: " + text(rng, 80)))
            assert turn(s, f"tool result {s}: " + text(rng, 450)) == homes[s]
        assert sorted(homes) == sorted(srv.name for srv in stack.fleet.servers), homes
        restarted = next(srv for srv in stack.fleet.servers if srv.name == homes[1])
        http.post(f"{restarted.url}/sim/restart").raise_for_status()
        wait_until(
            lambda: metric('extproc_endpoint_cache_invalidations_total{reason="restart"}') == 1,
            timeout_s=5,
            what="the picker to see the restart",
        )
        # Counted with session 1, each server was within the bound and the prompt's holder
        # (the other) took it; now only the restarted server is.
        assert turn(2, "task 2: " + text(rng, 80)) == restarted.name
        assert metric('extproc_session_bound_reset_sessions_total{filter="0"}') == 1
        # Session 1's next turn, its tail gone, is placed as a new session is.
        turn(1, "tool result 1b: " + text(rng, 100))
        assert metric('extproc_session_bound_reset_turns_total{filter="0"}') == 1
