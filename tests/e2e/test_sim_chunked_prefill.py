"""Chunked prefill through the whole path: Envoy, `extproc serve` with engine priority (the
band written into the body as `priority`) and a simulated vLLM with the priority policy.
A long batch prompt (~5,500 tokens: three 2,048-token steps of ~0.8 s here) is under way
when a short interactive request arrives:

- the simulator's default (vLLM's: `--long-prefill-token-threshold 0`): the long prompt's
  chunks take every step until its last, so the interactive request's first token comes
  no earlier than that last step (which it shares), its priority notwithstanding;
- `--long-prefill-token-threshold 256`: the step after the one under way has room for it,
  so its first token comes first (and well before the long prompt's would have alone).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import yaml

from extproc.stack import Stack, StackOptions
from tests.e2e.flow_configs import in_flight_scheduling

OBJECTIVE = "x-llm-d-inference-objective"
LONG = "The router sends the prefix to the server today. " * 500
ALONE_S = 5500 / 2500  # the long prompt's prefill alone, at the rate below
STEP_S = 2048 / 2500  # one full step at that rate


@pytest.fixture(scope="module", params=[0, 256], ids=lambda t: f"threshold{t}")
def stack(request, tmp_path_factory) -> Iterator[tuple[int, Stack]]:
    threshold = request.param
    tmp = tmp_path_factory.mktemp("chunked")
    (tmp / "objectives.yaml").write_text("interactive: 10\nbatch: -1\n")
    cfg = {
        "scheduling": in_flight_scheduling(),
        "flow_control": {"objectives_file": str(tmp / "objectives.yaml"), "engine_priority": True},
    }
    (tmp / "picker.yaml").write_text(yaml.safe_dump(cfg))
    sim = ("--scheduling-policy", "priority", "--prefill-tps", "2500",
           "--long-prefill-token-threshold", str(threshold))  # fmt: skip
    opts = StackOptions(
        upstreams=1, sim_args=sim, extproc_args=("--config", str(tmp / "picker.yaml"))
    )
    with Stack(opts) as s:
        yield threshold, s


def first_token(s: Stack, prompt: str, objective: str, t0: float) -> float:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 1, "stream": True}
    with httpx.stream("POST", f"{s.url}/v1/completions", json=body,
                      headers={OBJECTIVE: objective}, timeout=60) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data:"):
                return time.monotonic() - t0
    raise AssertionError("no token")


def test_an_interactive_request_during_a_long_batch_prefill(stack):
    threshold, s = stack
    done: dict[str, float] = {}
    t0 = time.monotonic()
    batch = threading.Thread(
        target=lambda: done.__setitem__("batch", first_token(s, LONG, "batch", t0))
    )
    batch.start()
    time.sleep(0.3)
    sent = time.monotonic() - t0
    done["interactive"] = first_token(s, "What is the answer?", "interactive", t0)
    batch.join()
    if threshold == 0:
        # Not before the long prompt's last step, which both share: the client may read
        # either first token first (CI: batch 2.3318 s, interactive 2.3307 s).
        assert done["batch"] <= done["interactive"] + 0.25 * STEP_S, done
        assert done["interactive"] > 0.8 * ALONE_S, done  # it waited out the long prefill
    else:
        assert done["interactive"] < done["batch"], done
        # The rest of the step under way, then one shared step, from whenever it reached
        # the engine (timed from its own send: on a loaded machine it may reach the engine
        # a step late, which is still "the next step").
        assert done["interactive"] - sent < STEP_S + 0.7, (sent, done)
