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

from extproc.stack import Stack, StackOptions, wait_until
from tests.e2e.agent_sessions import AgentSessions
from tests.e2e.test_session_spread import PARSE, SIM


def test_a_restarted_server_takes_the_next_session_its_old_ones_do_not_count(tmp_path):
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        sessions = AgentSessions(http, stack, random.Random(11))
        homes = sessions.two_growing()
        fleet = stack.fleet
        assert fleet is not None
        assert sorted(homes) == sorted(srv.name for srv in fleet.servers), homes
        restarted = next(srv for srv in fleet.servers if srv.name == homes[1])
        http.post(f"{restarted.url}/sim/restart").raise_for_status()
        wait_until(
            lambda: (
                sessions.metric('extproc_endpoint_cache_invalidations_total{reason="restart"}') == 1
            ),
            timeout_s=5,
            what="the picker to see the restart",
        )
        # Counted with session 1, each server was within the bound and the prompt's holder
        # (the other) took it; now only the restarted server is.
        assert sessions.task(2) == restarted.name
        assert sessions.metric('extproc_session_bound_reset_sessions_total{filter="0"}') == 1
        # Session 1's next turn, its tail gone, is placed as a new session is.
        sessions.tool(1, 100, "b")
        assert sessions.metric('extproc_session_bound_reset_turns_total{filter="0"}') == 1
