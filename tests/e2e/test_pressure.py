"""Placement under cache pressure through `extproc serve` behind Envoy: agentic sessions on
one shared agent prompt, caches that cannot hold them all on one server. The shared prefix
must spread to more servers (not pile every session onto the first holder), each session's
later turns stay where its tail grew, and the picker learns each server's capacity."""

from __future__ import annotations

import asyncio
from collections import Counter
from itertools import pairwise

import httpx

from extproc.sim.sessions import AgenticSpec, build_sessions, run_closed_loop
from extproc.stack import Stack, StackOptions

SIM = ("--fast", "4", "--prefill-tps", "5000", "--num-gpu-blocks", "700",
       "--max-model-len", "16384")  # fmt: skip
# The simulator's tokenizer (465 tokens) averages ~1.3 bytes per token where real ones average
# ~4: the picker is told, as calibration would find (calibration stays on and must leave it:
# a change of keys mid-run forgets every prefix, which is not what this test is about).
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"


def test_shared_agent_prompt_spreads_and_sessions_stay_put(tmp_path):
    spec = AgenticSpec(sessions=6, turns=4, agent_words=300, result_words=120, max_tokens=8,
                       think_s=0.05, stagger_s=0.05, seed=7)  # fmt: skip
    sessions = build_sessions(spec)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=3, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack:
        results, _ = asyncio.run(
            run_closed_loop(sessions, stack.url, think_s=spec.think_s, stagger_s=spec.stagger_s)
        )
        metrics = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics").text
    assert all(r.status == 200 for r in results), [r.error for r in results if r.error]
    per_server = Counter(r.served_by for r in results)
    assert len(per_server) >= 2, per_server
    assert max(per_server.values()) <= 0.75 * len(results), per_server
    by_index = {r.index: r for r in results}
    # After its first turn, a session's turns mostly land where its own tail is.
    stayed = moved = 0
    for turns in sessions:
        servers = [by_index[t.index].served_by for t in turns]
        for a, b in pairwise(servers[1:]):
            stayed += a == b
            moved += a != b
    assert stayed >= moved, (stayed, moved)
    assert sum(r.cached_tokens for r in results) > 0.4 * sum(r.prompt_tokens for r in results)
    assert "extproc_access_log_entries_total" in metrics
