"""A simulated server's `/metrics`: the engine's counters and histograms, written as
Prometheus text with vLLM 0.32's names, labels (`engine`, `model_name`), HELP strings and
buckets (tests/fixtures/vllm-0.32-cpu/metrics.txt), so scrapers cannot tell the difference.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
    10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)  # fmt: skip
LATENCY_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)  # fmt: skip
ITL_BUCKETS = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0,
)  # fmt: skip
FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")


def token_buckets(max_model_len: int) -> tuple[float, ...]:
    """vLLM's 1-2-5 series up to the model length."""
    out: list[float] = []
    mantissa = [1, 2, 5]
    exp = 1
    while True:
        for m in mantissa:
            value = m * exp
            if value > max_model_len:
                return tuple(out)
            out.append(float(value))
        exp *= 10


@dataclass(slots=True)
class Histogram:
    buckets: tuple[float, ...]
    counts: list[int] = field(init=False)
    total: float = 0.0
    count: int = 0

    def __post_init__(self) -> None:
        self.counts = [0] * (len(self.buckets) + 1)

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.total += value
        self.count += 1


@dataclass(slots=True)
class EngineStats:
    """Cumulative figures of one engine. Token counters are in tokens, times in wall
    seconds (multiply by the server's `speed` for simulated seconds)."""

    max_model_len: int
    created: float = field(default_factory=time.time)
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generation_tokens: int = 0
    prefix_queries: int = 0
    prefix_hits: int = 0
    mm_queries: int = 0
    mm_hits: int = 0
    finished: dict[str, int] = field(default_factory=lambda: dict.fromkeys(FINISH_REASONS, 0))
    ttft: Histogram = field(default_factory=lambda: Histogram(TTFT_BUCKETS))
    itl: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    e2e: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    queue_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    prefill_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    decode_time: Histogram = field(default_factory=lambda: Histogram(LATENCY_BUCKETS))
    tpot: Histogram = field(default_factory=lambda: Histogram(ITL_BUCKETS))
    prompt_hist: Histogram = field(init=False)
    generation_hist: Histogram = field(init=False)
    prefill_computed: Histogram = field(init=False)
    # The prefill lane's own clock (not in vLLM's exposition; `/sim/steps`): steps run,
    # tokens they computed, the seconds they were scheduled to take and the wall seconds
    # they took, wake-up and the woken requests' turn included. On a starved machine the
    # wall clock runs ahead of the schedule, while the histograms (scheduled ends) show the
    # nominal speed: the ratio is how much slower the lane really was than the speed a
    # picker learns.
    steps: int = 0
    step_tokens: int = 0
    step_scheduled_s: float = 0.0
    step_wall_s: float = 0.0

    def __post_init__(self) -> None:
        self.prompt_hist = Histogram(token_buckets(self.max_model_len))
        self.generation_hist = Histogram(token_buckets(self.max_model_len))
        # vLLM caps this one's 1-2-5 series at 2000 whatever the model length.
        self.prefill_computed = Histogram(token_buckets(min(self.max_model_len, 2000)))


@dataclass(frozen=True, slots=True)
class Gauges:
    running: int
    waiting: int
    kv_usage: float


def render(stats: EngineStats, gauges: Gauges, model: str, cache_config: Mapping[str, str]) -> str:
    """The Prometheus text exposition of one engine (HELP/TYPE, then samples)."""
    w = _Writer(model, stats.created)
    w.gauge("num_requests_running", "Number of requests in model execution batches.",
            gauges.running)  # fmt: skip
    w.gauge("num_requests_waiting", "Number of requests waiting to be processed.",
            gauges.waiting)  # fmt: skip
    w.gauge_family(
        "num_requests_waiting_by_reason",
        "Number of waiting requests by reason. Reason labels: 'capacity' = waiting for "
        "scheduling capacity; 'deferred' = deferred by transient constraints (LoRA budget, "
        "KV transfer, blocked status). Sum of all reasons equals vllm:num_requests_waiting.",
        "reason",
        {"capacity": gauges.waiting, "deferred": 0},
    )
    w.gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", gauges.kv_usage)
    w.counter("prefix_cache_queries",
              "Prefix cache queries, in terms of number of queried tokens.",
              {None: stats.prefix_queries})  # fmt: skip
    w.counter("prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.",
              {None: stats.prefix_hits})  # fmt: skip
    w.counter("mm_cache_queries",
              "Multi-modal cache queries, in terms of number of queried items.",
              {None: stats.mm_queries})  # fmt: skip
    w.counter("mm_cache_hits", "Multi-modal cache hits, in terms of number of cached items.",
              {None: stats.mm_hits})  # fmt: skip
    w.counter("num_preemptions", "Cumulative number of preemption from the engine.", {None: 0})
    w.counter("prompt_tokens", "Number of prefill tokens processed.", {None: stats.prompt_tokens})
    w.counter(
        "prompt_tokens_by_source",
        "Number of prompt tokens by source.",
        {
            "local_compute": stats.prompt_tokens - stats.cached_prompt_tokens,
            "local_cache_hit": stats.cached_prompt_tokens,
            "external_kv_transfer": 0,
        },
        label="source",
    )
    w.counter("prompt_tokens_cached", "Number of cached prompt tokens (local + external).",
              {None: stats.cached_prompt_tokens})  # fmt: skip
    w.counter("generation_tokens", "Number of generation tokens processed.",
              {None: stats.generation_tokens})  # fmt: skip
    w.counter("request_success", "Count of successfully processed requests.",
              dict(stats.finished), label="finished_reason")  # fmt: skip
    w.histogram("request_prompt_tokens", "Number of prefill tokens processed.",
                stats.prompt_hist)  # fmt: skip
    w.histogram("request_generation_tokens", "Number of generation tokens processed.",
                stats.generation_hist)  # fmt: skip
    w.histogram("time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                stats.ttft)  # fmt: skip
    w.histogram("inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                stats.itl)  # fmt: skip
    w.histogram("e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                stats.e2e)  # fmt: skip
    w.histogram("request_queue_time_seconds",
                "Histogram of time spent in WAITING phase for request.",
                stats.queue_time)  # fmt: skip
    w.histogram("request_prefill_time_seconds",
                "Histogram of time spent in PREFILL phase for request.",
                stats.prefill_time)  # fmt: skip
    w.histogram("request_decode_time_seconds",
                "Histogram of time spent in DECODE phase for request.",
                stats.decode_time)  # fmt: skip
    w.histogram("request_time_per_output_token_seconds",
                "Histogram of time_per_output_token_seconds per request.",
                stats.tpot)  # fmt: skip
    w.histogram("request_prefill_kv_computed_tokens",
                "Histogram of new KV tokens computed during prefill (excluding cached tokens).",
                stats.prefill_computed)  # fmt: skip
    w.info("cache_config_info", "Information of the LLMEngine CacheConfig", cache_config)
    # prometheus_client's process collector, as on a real server: a restart changes it.
    w.raw(
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.",
        "# TYPE process_start_time_seconds gauge",
        f"process_start_time_seconds {_num(stats.created)}",
    )
    return w.text()


def _num(value: float) -> str:
    return repr(float(value))


class _Writer:
    def __init__(self, model: str, created: float) -> None:
        self._lines: list[str] = []
        self._model = model
        self._created = created

    def text(self) -> str:
        return "\n".join(self._lines) + "\n"

    def raw(self, *lines: str) -> None:
        self._lines += lines

    def _labels(self, extra: Iterable[tuple[str, str]] = (), model: bool = True) -> str:
        pairs = dict(extra)
        pairs["engine"] = "0"
        if model:  # vLLM's info gauges carry no model_name
            pairs["model_name"] = self._model
        body = ",".join(f'{k}="{_escape(v)}"' for k, v in sorted(pairs.items()))
        return "{" + body + "}"

    def _head(self, name: str, help_: str, kind: str) -> None:
        self._lines += [f"# HELP vllm:{name} {help_}", f"# TYPE vllm:{name} {kind}"]

    def gauge(self, name: str, help_: str, value: float) -> None:
        self._head(name, help_, "gauge")
        self._lines.append(f"vllm:{name}{self._labels()} {_num(value)}")

    def gauge_family(self, name: str, help_: str, label: str, values: Mapping[str, float]) -> None:
        self._head(name, help_, "gauge")
        for key, value in values.items():
            self._lines.append(f"vllm:{name}{self._labels([(label, key)])} {_num(value)}")

    def counter(
        self,
        name: str,
        help_: str,
        values: Mapping[str, float] | Mapping[None, float],
        label: str = "",
    ) -> None:
        def labels(key: str | None) -> str:
            return self._labels([(label, key)] if key is not None else [])

        self._head(f"{name}_total", help_, "counter")
        for key, value in values.items():
            self._lines.append(f"vllm:{name}_total{labels(key)} {_num(value)}")
        self._head(f"{name}_created", help_, "gauge")
        for key in values:
            self._lines.append(f"vllm:{name}_created{labels(key)} {_num(self._created)}")

    def histogram(self, name: str, help_: str, hist: Histogram) -> None:
        self._head(name, help_, "histogram")
        cumulative = 0
        bounds: Sequence[str] = [_num(b) for b in hist.buckets] + ["+Inf"]
        for bound, count in zip(bounds, hist.counts, strict=True):
            cumulative += count
            self._lines.append(
                f"vllm:{name}_bucket{self._labels([('le', bound)])} {_num(cumulative)}"
            )
        self._lines.append(f"vllm:{name}_count{self._labels()} {_num(hist.count)}")
        self._lines.append(f"vllm:{name}_sum{self._labels()} {_num(hist.total)}")
        self._head(f"{name}_created", help_, "gauge")
        self._lines.append(f"vllm:{name}_created{self._labels()} {_num(self._created)}")

    def info(self, name: str, help_: str, labels: Mapping[str, str]) -> None:
        self._head(name, help_, "gauge")
        self._lines.append(f"vllm:{name}{self._labels(labels.items(), model=False)} 1.0")


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
