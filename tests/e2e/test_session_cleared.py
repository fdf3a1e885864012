"""A model server empties its prefix cache and keeps running (precise mode: `POST
/reset_prefix_cache`, published as a KV-event AllBlocksCleared) under live agent sessions,
through Envoy and `extproc serve` with the default profile: the sessions homed there lost
their tails, so the emptied server takes the next new session, and the next turn of a session
homed there is placed as a new session is. Counted on it, the server was as full as the other
and the new session went to the server holding the agent prompt.

tests/e2e/test_session_reset.py's scenario with a clear instead of a restart (sessions run one
after another, so only the bound decides); the clear is the sim's, as in
tests/e2e/test_precise_cleared.py."""

from __future__ import annotations

import random
import time

import httpx
import yaml

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import SimFleet, Stack, StackOptions, wait_until
from tests.e2e.test_session_spread import SIM, text


def test_a_server_that_cleared_its_cache_takes_the_next_session(tmp_path):
    rng = random.Random(11)
    agent = "You are a coding agent. " + text(rng, 600)
    with SimFleet(2, SIM, log_dir=tmp_path) as fleet:
        cfg = tmp_path / "picker.yaml"
        cfg.write_text(
            yaml.safe_dump(fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}"))
        )
        opts = StackOptions(fleet=fleet, log_dir=tmp_path, extproc_args=("--config", str(cfg)))
        with Stack(opts) as stack, httpx.Client(timeout=60) as http:
            time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's socket
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
            assert sorted(homes) == sorted(srv.name for srv in fleet.servers), homes
            # A sim is named by its address (the header), as the picker names it.
            http.post(f"http://{homes[1]}/reset_prefix_cache").raise_for_status()
            wait_until(
                lambda: metric("extproc_kv_events_clears_total") == 1,
                timeout_s=5,
                what="the picker to hear AllBlocksCleared",
            )
            # Counted with session 1, each server was within the bound and the prompt's
            # holder (the other) took it; now only the emptied server is.
            assert turn(2, "task 2: " + text(rng, 80)) == homes[1], homes
            assert metric('extproc_session_bound_reset_sessions_total{filter="0"}') == 1
            # Session 1's next turn, its tail gone, is placed as a new session is.
            turn(1, "tool result 1b: " + text(rng, 100))
            assert metric('extproc_session_bound_reset_turns_total{filter="0"}') == 1
