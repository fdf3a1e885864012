"""`extproc demo`: a real Envoy, the extproc picker and simulated vLLM servers on this
machine, one cache-heavy chat workload routed three ways, and the figures side by side.

    round-robin          Envoy alone (no picker), its round_robin balancer
    extproc approximate  the picker, cache guessed from its own past decisions
    extproc precise      the picker, cache known from the servers' KV events

Each policy gets a fresh stack (new servers, empty caches) and the same seeded workload at
the same Poisson arrival times. The simulated servers run `fast` times faster than the
rates they model, so a run that would take minutes on GPUs takes seconds.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

from extproc.sim.workload import (
    Result,
    Summary,
    WorkloadSpec,
    arrival_offsets,
    build_workload,
    run_open_loop,
    summarize,
)
from extproc.stack import SIM_TOKENIZER_DIR, Stack, StackOptions

POLICIES: tuple[tuple[str, dict], ...] = (
    ("round-robin", {"picker": False, "baseline": "round-robin"}),
    ("extproc approximate", {}),
    ("extproc precise", {"precise": True}),
)


@dataclass(frozen=True, slots=True)
class DemoConfig:
    """Sized so one policy runs ~10 s on 2 cores and the caches cannot hold every group on
    every server: round-robin spreads each group over all servers and thrashes, affinity
    keeps each group's prefix on one server. `gpu_blocks` is per server, 16 tokens each.

    The groups scale with the fleet (`groups_per_upstream`, 12 on the default 3 servers) so
    that holds at any size: a group's system prompt is ~3,350 tokens (~210 blocks), so one
    server's share of 4 groups (~840 blocks plus live conversations) fits its 1,200 blocks
    and every group on every server (8 x 210 on 2 servers, 12 x 210 on 3) does not. A fixed
    12 groups on 2 servers gave each server 6 (~1,260 blocks): affinity overflowed the cache
    too, and which prefixes survived depended on timing, so round-robin sometimes won."""

    requests: int = 300
    upstreams: int = 3
    rate_per_s: float = 25.0
    fast: float = 10.0
    gpu_blocks: int = 1200
    prefill_tps: float = 3000.0
    groups: int | None = None  # None: groups_per_upstream x upstreams
    groups_per_upstream: int = 4
    system_words: int = 700
    seed: int = 7

    @property
    def group_count(self) -> int:
        return self.groups if self.groups is not None else self.groups_per_upstream * self.upstreams

    def spec(self) -> WorkloadSpec:
        # Conversations of 3 turns; enough conversations per group to reach `requests`.
        groups = self.group_count
        convs = max(1, math.ceil(self.requests / (groups * 3)))
        return WorkloadSpec(
            groups=groups,
            conversations_per_group=convs,
            turns=3,
            system_words=self.system_words,
            question_words=25,
            answer_words=30,
            image_fraction=0.3,
            images_per_request=1,
            images_per_group=2,
            image_px=448,
            max_tokens=16,
            seed=self.seed,
        )

    def sim_args(self) -> tuple[str, ...]:
        return (
            "--fast", str(self.fast),
            "--num-gpu-blocks", str(self.gpu_blocks),
            "--prefill-tps", str(self.prefill_tps),
            "--seed", str(self.seed),
        )  # fmt: skip


def _system_tokens(spec: WorkloadSpec) -> int:
    """One group's system prompt in the simulated servers' tokens, to the nearest hundred
    (a word of the workload's made-up vocabulary is about five of them, not three)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(SIM_TOKENIZER_DIR / "tokenizer.json"))
    first = build_workload(replace(spec, groups=1, conversations_per_group=1, image_fraction=0))
    return round(len(tok.encode(first[0].body["messages"][0]["content"]).ids), -2)


def run_policy(
    name: str, overrides: dict, cfg: DemoConfig, on_done=None
) -> tuple[Summary, list[Result]]:
    items = build_workload(cfg.spec())[: cfg.requests]
    offsets = arrival_offsets(len(items), cfg.rate_per_s, cfg.seed)
    opts = StackOptions(upstreams=cfg.upstreams, sim_args=cfg.sim_args(), **overrides)
    with Stack(opts) as stack:
        if opts.precise:
            # ZMQ drops what a PUB sends before its reconnect to the picker's new socket
            # lands; give it a moment so the first requests' events are not lost.
            time.sleep(0.5)
        results, duration = asyncio.run(run_open_loop(items, offsets, stack.url, on_done=on_done))
    return summarize(results, duration), results


def _format_table(rows: list[tuple[str, Summary]], cfg: DemoConfig) -> str:
    head = (
        f"{'policy':<21} {'hit ratio':>9} {'TTFT p50':>9} {'TTFT p90':>9} "
        f"{'req/s':>6} {'out tok/s':>9} {'ok':>7}"
    )
    lines = [head, "-" * len(head)]
    for name, s in rows:
        lines.append(
            f"{name:<21} {s.hit_ratio:>8.1%} {s.ttft_p50_s * 1000:>7.1f}ms "
            f"{s.ttft_p90_s * 1000:>7.1f}ms {s.req_per_s:>6.1f} {s.output_tok_per_s:>9.0f} "
            f"{s.ok:>3}/{s.requests:<3}"
        )
    return "\n".join(lines)


def write_chart(rows: list[tuple[str, Summary]], path: Path, cfg: DemoConfig) -> str:
    """A PNG with three panels; returns a line for the console."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "chart skipped: matplotlib not installed (uv run --extra demo extproc demo)"
    names = [n.replace("extproc ", "extproc\n") for n, _ in rows]
    colors = ["#9e9e9e", "#4c72b0", "#2a9d8f"][: len(rows)]
    fig, axes = plt.subplots(1, 3, figsize=(12, 4))
    axes[0].bar(names, [s.hit_ratio * 100 for _, s in rows], color=colors)
    axes[0].set_title("prefix-cache hit ratio (%)")
    x = range(len(rows))
    axes[1].bar([i - 0.2 for i in x], [s.ttft_p50_s * 1000 for _, s in rows], 0.4,
                color=colors, label="p50")  # fmt: skip
    axes[1].bar([i + 0.2 for i in x], [s.ttft_p90_s * 1000 for _, s in rows], 0.4,
                color=colors, alpha=0.5, label="p90")  # fmt: skip
    axes[1].set_xticks(list(x), names)
    axes[1].set_title("TTFT ms (solid p50, light p90)")
    axes[2].bar(names, [s.output_tok_per_s for _, s in rows], color=colors)
    axes[2].set_title("output tokens/s")
    fig.suptitle(
        f"{cfg.requests} chat requests at {cfg.rate_per_s:g}/s, {cfg.upstreams} simulated "
        f"vLLM servers (time x{cfg.fast:g})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return f"chart written to {path}"


def run_demo(
    *,
    requests: int | None = None,
    upstreams: int | None = None,
    rate: float | None = None,
    fast: float | None = None,
    seed: int | None = None,
    chart: str | None = "extproc-demo.png",
    policies: tuple[str, ...] | None = None,
) -> int:
    """Runs the three policies and prints the table. Returns 0 when extproc beat
    round-robin on hit ratio (1 otherwise, 2 when a run failed)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

    base = DemoConfig()
    cfg = DemoConfig(
        requests=requests or base.requests,
        upstreams=upstreams or base.upstreams,
        rate_per_s=rate or base.rate_per_s,
        fast=fast or base.fast,
        seed=base.seed if seed is None else seed,
    )
    chosen = [(n, o) for n, o in POLICIES if policies is None or n in policies]
    spec = cfg.spec()
    print(
        f"extproc demo: {cfg.upstreams} simulated vLLM servers behind a real Envoy; "
        f"{cfg.requests} streaming chat requests at {cfg.rate_per_s:g}/s (Poisson, seed "
        f"{cfg.seed}): {spec.groups} groups sharing ~{_system_tokens(spec):,}-token system "
        f"prompts, 3-turn conversations, 30% with an image.\n"
        f"Simulated time runs x{cfg.fast:g}: prefill {cfg.prefill_tps:g} tok/s, KV cache "
        f"{cfg.gpu_blocks} blocks x 16 tokens per server, in simulated units; the figures "
        f"below are wall-clock.\n",
        flush=True,
    )
    rows: list[tuple[str, Summary]] = []
    t0 = time.monotonic()
    with Progress(
        TextColumn("{task.description:<21}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[note]}"),
    ) as progress:
        for name, overrides in chosen:
            task = progress.add_task(name, total=cfg.requests, note="starting stack")

            def done(res: Result, task=task) -> None:
                progress.update(task, advance=1, note="" if res.status == 200 else "errors")

            progress.update(task, note="")
            summary, _ = run_policy(name, overrides, cfg, on_done=done)
            progress.update(task, note=f"hit {summary.hit_ratio:.0%}")
            rows.append((name, summary))
    print()
    print(_format_table(rows, cfg))
    print(f"\n(all {len(rows)} runs in {time.monotonic() - t0:.0f}s; every process stopped)")
    if chart:
        print(write_chart(rows, Path(chart), cfg))
    if any(s.ok < s.requests for _, s in rows):
        return 2
    by = dict(rows)
    rr = by.get("round-robin")
    if rr is None:
        return 0
    best = [s for n, s in rows if n.startswith("extproc")]
    return 0 if all(s.hit_ratio > rr.hit_ratio for s in best) else 1
