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

from extproc.stack import SimFleet, Stack, StackOptions, wait_until
from tests.e2e.agent_sessions import AgentSessions
from tests.e2e.test_session_spread import SIM


def test_a_server_that_cleared_its_cache_takes_the_next_session(tmp_path):
    with SimFleet(2, SIM, log_dir=tmp_path) as fleet:
        cfg = tmp_path / "picker.yaml"
        cfg.write_text(
            yaml.safe_dump(fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}"))
        )
        opts = StackOptions(fleet=fleet, log_dir=tmp_path, extproc_args=("--config", str(cfg)))
        with Stack(opts) as stack, httpx.Client(timeout=60) as http:
            time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's socket
            sessions = AgentSessions(http, stack, random.Random(11))
            homes = sessions.two_growing()
            assert sorted(homes) == sorted(srv.name for srv in fleet.servers), homes
            # A sim is named by its address (the header), as the picker names it.
            http.post(f"http://{homes[1]}/reset_prefix_cache").raise_for_status()
            wait_until(
                lambda: sessions.metric("extproc_kv_events_clears_total") == 1,
                timeout_s=5,
                what="the picker to hear AllBlocksCleared",
            )
            # Counted with session 1, each server was within the bound and the prompt's
            # holder (the other) took it; now only the emptied server is.
            assert sessions.task(2) == homes[1], homes
            assert sessions.metric('extproc_session_bound_reset_sessions_total{filter="0"}') == 1
            # Session 1's next turn, its tail gone, is placed as a new session is.
            sessions.tool(1, 100, "b")
            assert sessions.metric('extproc_session_bound_reset_turns_total{filter="0"}') == 1
