"""Predicted-latency routing end to end: `extproc serve` behind a real Envoy, three
simulated vLLM servers, the latency model learning from their scraped histograms. One
server is slowed mid-run (another tenant on its GPU): it ends up with a small share of
the traffic, the picker's metrics show what it learned, and the predicted TTFT returned to
the client tracks the measured one."""

from __future__ import annotations

import asyncio
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from extproc.sim.workload import WorkloadSpec, arrival_offsets, build_workload, run_open_loop
from extproc.stack import Stack, StackOptions

# The default request end (in-flight held until the gateway's access log, issue 14): the
# model reads only scraped histograms and its own placements, never in-flight counts.
CONFIG = """\
scheduling:
  apiVersion: llm-d.ai/v1alpha1
  kind: EndpointPickerConfig
  plugins:
  - type: predicted-latency-producer
    parameters: {responseHeader: true}
  - type: latency-scorer
  - type: max-score-picker
  schedulingProfiles:
  - name: default
    plugins:
    - pluginRef: predicted-latency-producer
    - pluginRef: latency-scorer
    - pluginRef: max-score-picker
"""
# Real time (--fast 1): 20,000 prefill tokens/s, so a ~1,200-token prompt takes ~60 ms on
# a full-speed server and ~400 ms once slowed to 0.15.
SIM_ARGS = ("--fast", "1", "--prefill-tps", "20000", "--decode-tps", "200")


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    cfg: Path = tmp_path_factory.mktemp("latency") / "picker.yaml"
    cfg.write_text(CONFIG)
    opts = StackOptions(upstreams=3, sim_args=SIM_ARGS, extproc_args=("--config", str(cfg)))
    with Stack(opts) as s:
        yield s


def run(stack: Stack, n: int, rate: float, seed: int):
    items = build_workload(
        WorkloadSpec(groups=n, conversations_per_group=1, turns=1, system_words=400,
                     question_words=10, max_tokens=4, seed=seed)
    )  # fmt: skip
    results, _ = asyncio.run(run_open_loop(items, arrival_offsets(n, rate, seed), stack.url))
    assert all(r.status == 200 for r in results), [r.error for r in results if r.error]
    return results


def picker_metrics(stack: Stack) -> str:
    return httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text


def test_a_server_slowed_mid_run_gets_less_traffic(stack: Stack):
    assert stack.fleet is not None
    servers = [s.name for s in stack.fleet.servers]
    slow = servers[0]
    # The model learns every server at full speed. A server the scorer left nearly idle may
    # need another batch before it has its own fit (3 timed intervals); the fit, not the
    # number of requests it took, is what this test is about.
    for seed in range(1, 5):
        run(stack, 30, 12.0, seed=seed)
        text = picker_metrics(stack)
        if 'extproc_latency_endpoints{state="warm"} 3.0' in text:
            break
    assert 'extproc_latency_endpoints{state="warm"} 3.0' in text
    assert "extproc_latency_learning 1.0" in text

    url = stack.fleet.servers[0].url
    httpx.post(f"{url}/sim/speed", json={"relative_speed": 0.15}, timeout=5).raise_for_status()
    run(stack, 30, 12.0, seed=12)  # requests placed there now show it is slow
    measured = run(stack, 45, 12.0, seed=13)

    share = {s: sum(r.served_by == s for r in measured) for s in servers}
    fast = [share[s] for s in servers[1:]]
    assert share[slow] < 0.4 * min(fast), share

    # What the model learned, as the metrics show it: the prefill time it predicts for a
    # typical ~1,200-token prompt, from its fitted per-request and per-token terms (the
    # tokens/s gauge is absent for a server whose few samples only pin down the mean).
    terms: dict[str, dict[str, float]] = {}
    for m in re.finditer(
        r'extproc_latency_model_seconds\{endpoint="([^"]+)",term="([^"]+)"\} (\S+)',
        picker_metrics(stack),
    ):
        terms.setdefault(m.group(1), {})[m.group(2)] = float(m.group(3))

    def prefill_s(address: str) -> float:
        t = terms[address]
        return t["per_request"] + t["per_token"] * 1200

    fast_s = [prefill_s(s) for s in servers[1:]]
    assert prefill_s(slow) > 2 * max(fast_s), terms

    # The picker's prediction, returned in a header, against the client's measurement.
    pairs = [(r.predicted_ttft_s, r.ttft_s) for r in measured if r.predicted_ttft_s and r.ttft_s]
    assert len(pairs) == len(measured)
    ape = statistics.median(abs(p - m) / m for p, m in pairs)
    # Loose: these TTFTs are 0.1-0.3 s and a loaded 2-core machine adds tens of ms to any of
    # them (median error 0.35 seen once in 8 runs at load 10); bench/RESULTS.md measures it.
    assert ape < 0.5, ape
