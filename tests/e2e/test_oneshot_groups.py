"""A one-shot prefix group through Envoy and `extproc serve` with the default profile (issue
14, twenty-third session): a system prompt every request of the group shares, each request a
new question, none ever continued (bench_routing's text and multimodal workloads). Its first
request goes unanswered by any later turn; once the horizon has passed (the 2 s floor: no
session here ever came back), the picker has learned that sessions on the prompt grow 0
blocks, and the group's repeats are left to the scorers instead of being bounded as new agent
sessions (before, every repeat was bounded and the prompt's holder filtered out while few
sessions were live). tests/e2e/test_session_spread.py holds the other side: first turns sent
one after another within the floor are still dealt out 2/2/2/2."""

from __future__ import annotations

import json
import random
import time

import httpx

from extproc.protocol import DECISION_HEADER, EXPLAIN_HEADER
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions

SIM = ("--fast", "4", "--prefill-tps", "5000", "--num-gpu-blocks", "2000")
TOKEN = "oneshot-groups-token"
# Told, as calibration would find: a change of keys mid-test would forget every prefix.
CONFIG = (
    "parse: {block_tokens: 16, bytes_per_token: 1}\n" + f"server: {{explain_tokens: [{TOKEN}]}}\n"
)
WORDS = ("chart", "image", "caption", "table", "figure", "axis", "legend", "value", "unit", "row")
# The default floor of bounded-sessions-filter's horizon, and a margin.
FLOOR_S = 2.0 + 0.3


def test_a_one_shot_groups_repeats_stay_with_its_prompt_once_its_first_went_uncontinued(
    tmp_path,
):
    rng = random.Random(11)
    system = "You describe documents. " + " ".join(rng.choice(WORDS) for _ in range(500))
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(CONFIG)
    opts = StackOptions(
        upstreams=4, sim_args=SIM, extproc_args=("--config", str(cfg)), allow_explain=True
    )
    served: list[str] = []
    reasons: list[list[str]] = []
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        for q in range(5):
            if q == 1:
                time.sleep(FLOOR_S)  # the first request, never continued, passes its horizon
            question = f"question {q}: " + " ".join(rng.choice(WORDS) for _ in range(20))
            body = {
                "model": "tiny",
                "max_tokens": 2,
                "messages": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": question},
                ],
            }
            r = http.post(
                f"{stack.url}/v1/chat/completions", json=body, headers={EXPLAIN_HEADER: TOKEN}
            )
            assert r.status_code == 200, r.text
            served.append(r.headers[SERVED_BY_HEADER])
            reasons.append(json.loads(r.headers[DECISION_HEADER])["reasons"])
        metrics = http.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics").text
    bounded = [r for rs in reasons for r in rs if r.startswith("default/bounded-sessions-filter")]
    assert bounded == [], (served, reasons)
    bound = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("extproc_session_bound_") and "_total{" in line
    }
    # The first request learned from (at least), and the four repeats kept together.
    assert bound["extproc_session_bound_uncontinued_learned_total"] >= 1, bound
    assert bound["extproc_session_bound_kept_together_total"] == 4, (bound, served)
