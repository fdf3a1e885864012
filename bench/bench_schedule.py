"""Decision time: filters + scorers + picker (index lookup excluded) for 8, 64 and 512
endpoints, with the default profile and a full profile (every built-in scorer, the affinity
filter). Baseline in the same run: a bare random choice over the same candidates.
`--timing`: instead, the cost of llm-d's scheduling metrics (per-plugin and end-to-end
timing, scheduling/timing.py) against the same scheduler uninstrumented, calls interleaved.

    uv run python bench/bench_schedule.py [--iterations 20000] [--timing]
"""

from __future__ import annotations

import argparse
import random
import statistics
import textwrap
import time

import yaml

from extproc.config import build_configured_scheduler, decode_settings
from extproc.core import Candidate, Endpoint, EndpointState, InferenceRequest, MediaItem, Modality

FULL = textwrap.dedent(
    """\
    kind: EndpointPickerConfig
    plugins:
    - type: prefix-cache-affinity-filter
    - type: prefix-cache-scorer
    - type: queue-scorer
    - type: kv-cache-utilization-scorer
    - type: active-request-scorer
    - type: token-load-scorer
    - type: load-aware-scorer
    - type: lora-affinity-scorer
    - type: session-affinity-scorer
    - type: no-hit-lru-scorer
    - type: mm-embeddings-cache-scorer
    - type: max-score-picker
    schedulingProfiles:
    - name: default
      plugins:
      - {pluginRef: prefix-cache-affinity-filter}
      - {pluginRef: prefix-cache-scorer, weight: 3}
      - {pluginRef: queue-scorer, weight: 2}
      - {pluginRef: kv-cache-utilization-scorer, weight: 2}
      - {pluginRef: active-request-scorer, weight: 2}
      - {pluginRef: token-load-scorer, weight: 1}
      - {pluginRef: load-aware-scorer, weight: 1}
      - {pluginRef: lora-affinity-scorer, weight: 1}
      - {pluginRef: session-affinity-scorer, weight: 1}
      - {pluginRef: no-hit-lru-scorer, weight: 1}
      - {pluginRef: mm-embeddings-cache-scorer, weight: 1}
      - {pluginRef: max-score-picker}
    """
)


def candidates(n: int, rng: random.Random) -> list[Candidate]:
    return [
        Candidate(
            Endpoint(f"127.0.{i // 250}.{i % 250 + 1}:8000"),
            EndpointState(
                waiting=rng.randrange(20),
                running=rng.randrange(64),
                kv_usage=rng.random(),
                inflight_requests=rng.randrange(30),
                inflight_tokens=rng.randrange(50_000),
                age_s=0.05,
                is_stale=False,
            ),
            prefix_blocks=float(rng.randrange(0, 64)) if rng.random() < 0.3 else 0.0,
        )
        for i in range(n)
    ]


def measure(fn, iterations: int) -> tuple[float, float]:
    samples = []
    for _ in range(iterations):
        t = time.perf_counter_ns()
        fn()
        samples.append(time.perf_counter_ns() - t)
    samples.sort()
    return statistics.median(samples) / 1e3, samples[int(len(samples) * 0.99)] / 1e3


def measure_pair(a, b, iterations: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """p50/p99 µs of `a` and of `b`, calls alternating so load noise hits both alike."""
    sa, sb = [], []
    for _ in range(iterations):
        t = time.perf_counter_ns()
        a()
        t1 = time.perf_counter_ns()
        b()
        t2 = time.perf_counter_ns()
        sa.append(t1 - t)
        sb.append(t2 - t1)
    out = []
    for s in (sa, sb):
        s.sort()
        out.append((statistics.median(s) / 1e3, s[int(len(s) * 0.99)] / 1e3))
    return out[0], out[1]


def timing_cost(req: InferenceRequest, iterations: int, rng: random.Random) -> None:
    from extproc.scheduling.timing import instrument
    from extproc.server.llmd_metrics import LlmdMetrics

    configs = {"default": decode_settings({}), "full": decode_settings(yaml.safe_load(FULL))}
    print("| endpoints | profile | plain p50 / p99 µs | timed p50 / p99 µs | added p50 µs |")
    print("|---|---|---|---|---|")
    for n in (8, 64, 512):
        cands = candidates(n, rng)
        iters = max(1000, iterations // max(1, n // 8))
        for name, cfg in configs.items():
            plain = build_configured_scheduler(cfg)
            timed = instrument(build_configured_scheduler(cfg), LlmdMetrics())
            p, t = measure_pair(
                lambda c=cands, s=plain: s.schedule(req, c),
                lambda c=cands, s=timed: s.schedule(req, c),
                iters,
            )
            print(
                f"| {n} | {name} | {p[0]:.1f} / {p[1]:.1f} | {t[0]:.1f} / {t[1]:.1f} "
                f"| {t[0] - p[0]:+.1f} |",
                flush=True,
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--iterations", type=int, default=20_000)
    ap.add_argument("--timing", action="store_true", help="cost of llm-d's scheduling metrics")
    args = ap.parse_args()
    rng = random.Random(7)
    req = InferenceRequest(
        request_id="r",
        path="/v1/chat/completions",
        model="m",
        prompt_tokens=4000,
        block_keys=tuple(range(64)),
        block_tokens=64,
        media=(MediaItem(Modality.IMAGE, "h", 256),),
    )
    if args.timing:
        timing_cost(req, args.iterations, rng)
        return
    profiles = {
        "default": build_configured_scheduler(decode_settings({})),
        "full": build_configured_scheduler(decode_settings(yaml.safe_load(FULL))),
    }
    print(
        "| endpoints | random choice p50 / p99 µs | default profile p50 / p99 µs "
        "| full profile p50 / p99 µs | full / baseline p50 |"
    )
    print("|---|---|---|---|---|")
    for n in (8, 64, 512):
        cands = candidates(n, rng)
        iters = max(1000, args.iterations // max(1, n // 8))
        base = measure(lambda c=cands: rng.choice(c), iters)
        d = measure(lambda c=cands: profiles["default"].schedule(req, c), iters)
        f = measure(lambda c=cands: profiles["full"].schedule(req, c), iters)
        print(
            f"| {n} | {base[0]:.2f} / {base[1]:.2f} | {d[0]:.1f} / {d[1]:.1f} "
            f"| {f[0]:.1f} / {f[1]:.1f} | {f[0] / base[0]:.0f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
