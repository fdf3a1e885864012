"""A repeat of a one-shot group's prompt whose holder is queued, on a busy fleet, through Envoy
and `extproc serve` (issue 14): predicted TTFT alone sends it to the one idle server, which
recomputes the whole prompt (the prediction is the repeat's own first token, sooner there);
`spillCost: fleetBusy` (the default) charges that second prefill at the share of busy
candidates, the lane time later requests queue behind, and the repeat stays on its holder. At
multimodal 16 req/s such spills cost the fleet hit ratio and TTFT (bench/RESULTS.md, issue
14, twenty-third and twenty-fourth sessions).

Deterministic: the queues are the picker's own virtual queues of three streams held open,
predicted at the scorer's prior speed (the server left idle is never measured; the others'
measured speeds, should a prefill end before the explanation, leave the queues placed at
the prior as they are), and the repeat is explained, never sent."""

from __future__ import annotations

import json
import random
import time

import httpx
import pytest

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack, StackOptions
from tests.e2e.chat_bodies import chat, distinct_chat, text
from tests.e2e.chat_turns import ChatTurns
from tests.e2e.profiles import default_profile_with
from tests.e2e.test_request_end import picker_metric

# Prefill of ~1-1.5 s a held stream: in prefill while the repeat is explained, ended soon
# after (the test reads them out; a server stopped mid-prefill holds its handler open).
SIM = ("--prefill-tps", "4000", "--num-gpu-blocks", "4000")
# Told, as calibration would find. Estimated tokens are bytes, and the scorer's prior speed
# is 1,000 of them a second, so prompts of a few thousand
# bytes are seconds of predicted prefill and the test's own latency is small beside them.
# bounded-sessions-filter learns a one-shot group's repeats may stay together once its first
# request has gone uncontinued for the horizon: its floor shortened from 2 s, so the test
# waits 0.4 s instead (tests/e2e/test_oneshot_groups.py waits the default).
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"
HORIZON_S = 0.3
SCORER = "default/predicted-ttft-scorer"


@pytest.mark.parametrize("spill", ["default", "ignore"])
def test_a_repeat_stays_on_its_queued_holder_while_the_fleet_is_busy(tmp_path, spill):
    rng = random.Random(3)
    ttft: dict = {"priorPrefillTokensPerSecond": 1000}
    if spill != "default":  # the default: `fleetBusy`
        ttft["spillCost"] = spill
    params = {
        "predicted-ttft-scorer": ttft,
        "bounded-sessions-filter": {"uncontinuedFloorSeconds": HORIZON_S},
    }
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE + default_profile_with(params))
    opts = StackOptions(upstreams=4, sim_args=SIM, extproc_args=("--config", str(cfg)))
    # The group's prompt: ~3,000 bytes, ~3 s of prefill to the picker. Its first request's
    # question adds ~1.7 s: queued behind it, the holder is ~1.5x what the repeat costs on
    # an idle server, more than that recompute (predicted TTFT alone moves the repeat) and
    # less than it plus 3/4 of it again (the charge with 3 of 4 candidates busy).
    system = "You answer from the handbook. " + text(rng, 430)
    first = chat(system, text(rng, 240), stream=True)
    repeat = chat(system, "a short new question")
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        url = f"{stack.url}/v1/chat/completions"
        with (
            http.stream("POST", url, json=first) as held,
            # Two new prompts of ~8 s each go where nothing is queued: the two servers
            # neither the holder nor the one left idle.
            http.stream("POST", url, json=distinct_chat("tiny", 1, 2, words=1000)) as busy1,
            http.stream("POST", url, json=distinct_chat("tiny", 2, 2, words=1000)) as busy2,
        ):
            holder = held.headers[SERVED_BY_HEADER]
            busy = {busy1.headers[SERVED_BY_HEADER], busy2.headers[SERVED_BY_HEADER]}
            time.sleep(HORIZON_S + 0.1)
            got = ChatTurns(http, stack).explain(repeat)
            for stream in (held, busy1, busy2):
                stream.read()
        charged = picker_metric(stack, "extproc_predicted_ttft_spill_cost_total")
    why = json.dumps(got)
    assert holder not in busy and len(busy) == 2, (holder, busy)
    scores = got["scores"][SCORER]
    (idle,) = set(scores) - busy - {holder}
    assert got["prefix_blocks"][holder] > got["prefix_blocks"].get(idle, 0), why
    terms = got["terms"][SCORER]
    # The window: the repeat's own first token is sooner on the idle server.
    assert terms[idle]["predicted_s"] < terms[holder]["predicted_s"], why
    if spill == "default":
        assert got["endpoints"] == [holder], why
        assert scores[holder] == 1.0 > scores[idle], why
        assert terms[idle]["fleet_busy"] == 0.75, why
        assert terms[idle]["spill_cost_s"] > 2.0 > terms[holder]["spill_cost_s"], why
        assert charged >= 1, charged
    else:
        assert got["endpoints"] == [idle], why
        assert "spill_cost_s" not in terms[idle], why
        assert charged == 0, charged
