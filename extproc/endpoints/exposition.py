"""Prometheus text exposition, read for the few figures the picker routes on.

`parse_metrics` turns one `/metrics` body (vLLM or SGLang) into a frozen `Scraped`; nothing
past it sees metric text. The scrape loop that fetches bodies is `scrape.py`.
"""

from __future__ import annotations

import math
import re

import msgspec

from extproc.core import LatencyTotals


class MetricsError(ValueError):
    """A body that is not usable metrics text (no known load figure, or a bad sample)."""


class Scraped(msgspec.Struct, frozen=True):
    """What one scrape says about an endpoint's engine.

    `waiting` / `running` are request counts summed over the engine's label sets (one per
    data-parallel engine). `kv_usage` is the KV-cache fill, a 0..1 fraction averaged over
    engines (a sum would pass 1). `kv_block_size` (tokens per block) and `kv_blocks` (GPU
    blocks, summed over engines) come from the cache config; `None` when not exposed.
    LoRA fields come from the newest `vllm:lora_requests_info` sample. Prefix-cache counters
    are cumulative tokens since the engine started (`None` when not exposed).
    """

    waiting: int = 0
    running: int = 0
    kv_usage: float = 0.0
    kv_block_size: int | None = None
    kv_blocks: int | None = None
    max_adapters: int | None = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    prefix_cache_queries: int | None = None
    prefix_cache_hits: int | None = None
    # prometheus_client's `process_start_time_seconds` (unix seconds): a new value is a new
    # engine process, whose cache is empty whatever the index believes.
    process_start_s: float | None = None
    # Prompt tokens the engine processed since it started (cached ones included).
    prompt_tokens: int | None = None
    latency: LatencyTotals | None = None
    # Requests the engine finished since it started (vLLM's `request_success_total`), every
    # finish reason summed but `abort`; None when not exported. With the first-token count
    # (`latency.ttft_count`) it says how many are decoding. Aborts are left out because
    # engines differ: vLLM 0.32 never counts a request the client cut, an engine that does
    # counts it under `abort` whether it had a first token or not, and only the ones after
    # it are in the first-token count. Without them, both engines read alike: a cut before
    # a first token leaves no trace, one after it is a first token never finished (which
    # endpoints/state.py learns).
    finished: int | None = None


# The parser.
#
# A vLLM 0.32 scrape is ~54 KB and ~660 lines, of which we need about six. A generic parser
# builds every family (~200x slower, bench/bench_scrape.py). Here one regex per server kind,
# anchored on a literal "\n<kind>:" prefix so re's fast literal search skips the rest,
# picks out the wanted lines in a single pass, and only those are decoded. Of the ~45 us
# per vLLM scrape, the single pass is ~25 us.

_LBRACE = 123
_UNESCAPE = {b"\\\\": b"\\", b'\\"': b'"', b"\\n": b"\n"}
_ESCAPE_SEQ = re.compile(rb"\\[\\\"n]")

_V_WAITING = b"num_requests_waiting"
_V_RUNNING = b"num_requests_running"
_V_KV = b"kv_cache_usage_perc"
_V_KV_OLD = b"gpu_cache_usage_perc"  # before vLLM 0.10
_V_CACHE_CONFIG = b"cache_config_info"
_V_LORA = b"lora_requests_info"
# Counters carry `_total` on the wire; the bare name is accepted too (OpenMetrics family
# names), and the `gpu_` prefix is the V1 engine's older spelling. First present wins.
_V_QUERIES = (
    b"prefix_cache_queries_total",
    b"prefix_cache_queries",
    b"gpu_prefix_cache_queries_total",
    b"gpu_prefix_cache_queries",
)
_V_HITS = (
    b"prefix_cache_hits_total",
    b"prefix_cache_hits",
    b"gpu_prefix_cache_hits_total",
    b"gpu_prefix_cache_hits",
)
_V_PROMPT_TOKENS = (b"prompt_tokens_total", b"prompt_tokens")
_V_FINISHED = (b"request_success_total", b"request_success")
# Latency histograms (sum and count lines only; the buckets are never decoded).
_V_HIST = {
    "ttft": b"time_to_first_token_seconds",
    "queue": b"request_queue_time_seconds",
    "prefill": b"request_prefill_time_seconds",
    "itl": b"inter_token_latency_seconds",
    "tpot": b"request_time_per_output_token_seconds",
    "prompt": b"request_prompt_tokens",
    "decode": b"request_decode_time_seconds",
}
_V_TPOT_OLD = b"time_per_output_token_seconds"  # before vLLM 0.11
_V_KV_COMPUTED = b"request_prefill_kv_computed_tokens_sum"
_V_BY_SOURCE = b"prompt_tokens_by_source_total"
_V_HIST_LINES = tuple(
    n + suffix for n in (*_V_HIST.values(), _V_TPOT_OLD) for suffix in (b"_sum", b"_count")
)
_S_WAITING = b"num_queue_reqs"
_S_RUNNING = b"num_running_reqs"
_S_KV = b"token_usage"


def _family(kind: bytes, names: tuple[bytes, ...]) -> tuple[re.Pattern[bytes], re.Pattern[bytes]]:
    # Exactly these names: `[ {]` after the name rejects `name_created` and longer names;
    # the line-start anchor rejects `# HELP name`. The second pattern serves line one.
    alt = b"|".join(re.escape(n) for n in sorted(names, key=len, reverse=True))
    body = re.escape(kind) + b":(" + alt + rb")([ {][^\n]*)"
    return re.compile(b"\n" + body), re.compile(body)


_V_LOAD = (_V_WAITING, _V_RUNNING, _V_KV, _V_KV_OLD, _V_CACHE_CONFIG, _V_LORA)
_VLLM = _family(
    b"vllm",
    (
        *_V_LOAD,
        *_V_QUERIES,
        *_V_HITS,
        *_V_HIST_LINES,
        _V_KV_COMPUTED,
        _V_BY_SOURCE,
        *_V_PROMPT_TOKENS,
        *_V_FINISHED,
    ),
)
_SGLANG = _family(b"sglang", (_S_WAITING, _S_RUNNING, _S_KV))
# Anchored on the literal newline (the body's first line is matched apart): with `(?:^|\n)`
# in front the regex engine tried every position of the body, 1 ms on the simulator's
# 28 KB scrape (65 us on vLLM's 54 KB), most of a scrape's parse (RESULTS, issue 14,
# fifteenth session).
_START = re.compile(rb"\nprocess_start_time_seconds ([^\s]+)")
_START_FIRST = re.compile(rb"process_start_time_seconds ([^\s]+)")


def _samples(
    data: bytes, family: tuple[re.Pattern[bytes], re.Pattern[bytes]]
) -> dict[bytes, list[bytes]]:
    """Wanted metric name -> the rest of each of its sample lines (labels, value, ts)."""
    found = family[0].findall(data)
    first = family[1].match(data)
    if first is not None:
        found.append(first.groups())
    out: dict[bytes, list[bytes]] = {}
    for name, rest in found:
        out.setdefault(name, []).append(rest)
    return out


def _split(rest: bytes) -> tuple[bytes, float]:
    """`{labels} value [ts]` or ` value [ts]` -> (labels, value)."""
    if rest[0] == _LBRACE:
        # Label values may hold spaces but never a `}` after the closing one.
        close = rest.rfind(b"}")
        if close < 0:
            raise MetricsError(f"unterminated labels: {rest[:80]!r}")
        labels, tail = rest[1:close], rest[close + 1 :]
    else:
        labels, tail = b"", rest
    parts = tail.split()
    if not parts:
        raise MetricsError(f"sample without a value: {rest[:80]!r}")
    try:
        return labels, float(parts[0])
    except ValueError:
        raise MetricsError(f"bad sample value: {parts[0][:40]!r}") from None


def _values(rests: list[bytes] | None) -> list[float]:
    if not rests:
        return []
    return [v for _, v in map(_split, rests) if not math.isnan(v)]


def _unescape(m: re.Match[bytes]) -> bytes:
    return _UNESCAPE[m.group(0)]


def _label(raw: bytes, key: bytes) -> str | None:
    """One label's value from a label set, without parsing the others: vLLM's
    cache_config_info carries ~40 labels (~1.5 KB) and we want two of them."""
    needle = key + b'="'
    i = raw.find(needle)
    while i > 0 and raw[i - 1] not in b", {":  # `hash_block_size` is not `block_size`
        i = raw.find(needle, i + 1)
    if i < 0:
        return None
    start = j = i + len(needle)
    while True:
        j = raw.find(b'"', j)
        if j < 0:
            raise MetricsError(f"unterminated label value: {raw[start - len(needle) :][:80]!r}")
        # A quote preceded by an odd run of backslashes is escaped.
        k = j
        while k > start and raw[k - 1] == 92:
            k -= 1
        if (j - k) % 2 == 0:
            break
        j += 1
    v = raw[start:j]
    if b"\\" in v:
        return _ESCAPE_SEQ.sub(_unescape, v).decode("utf-8", "replace")
    return v.decode("utf-8", "replace")


def _int_label(raw: bytes, key: bytes) -> int | None:
    v = _label(raw, key)
    try:
        return None if v is None else int(v)
    except ValueError:  # "None", as vLLM prints unset options
        return None


def _names(csv: str | None) -> frozenset[str]:
    if not csv:
        return frozenset()
    return frozenset(s for s in (p.strip() for p in csv.split(",")) if s)


def _counter(found: dict[bytes, list[bytes]], names: tuple[bytes, ...]) -> int | None:
    for name in names:
        vals = _values(found.get(name))
        if vals:
            return int(sum(vals))
    return None


def _finished(found: dict[bytes, list[bytes]]) -> int | None:
    """`request_success_total` summed over every finish reason but `abort` (see Scraped)."""
    for name in _V_FINISHED:
        samples = found.get(name)
        if not samples:
            continue
        total = 0.0
        for rest in samples:
            raw, value = _split(rest)
            if math.isnan(value) or _label(raw, b"finished_reason") == "abort":
                continue
            total += value
        return int(total)
    return None


def _latency(found: dict[bytes, list[bytes]]) -> LatencyTotals | None:
    """The latency histograms' totals, None when the server exports none of them."""
    totals: dict[str, float] = {}
    for key, name in _V_HIST.items():
        sums = _values(found.get(name + b"_sum"))
        counts = _values(found.get(name + b"_count"))
        if key == "tpot" and not counts:
            sums = _values(found.get(_V_TPOT_OLD + b"_sum"))
            counts = _values(found.get(_V_TPOT_OLD + b"_count"))
        if counts:
            totals[f"{key}_sum"] = sum(sums)
            totals[f"{key}_count"] = sum(counts)
    if not totals:
        return None
    tokens: float | None = None
    computed = _values(found.get(_V_KV_COMPUTED))
    if computed:
        tokens = sum(computed)
    else:
        for rest in found.get(_V_BY_SOURCE, ()):
            raw, value = _split(rest)
            if _label(raw, b"source") == "local_compute" and not math.isnan(value):
                tokens = (tokens or 0.0) + value
    return LatencyTotals(**totals, prefill_tokens=tokens)


def parse_metrics(data: bytes) -> Scraped:
    """Read the load figures of a vLLM or SGLang `/metrics` body (Prometheus text or
    OpenMetrics). Raises `MetricsError` when no known load figure is present or a wanted
    sample is malformed; other metrics are never looked at."""
    found = _samples(data, _VLLM)
    if found:
        waiting = _values(found.get(_V_WAITING))
        running = _values(found.get(_V_RUNNING))
        kv = _values(found.get(_V_KV)) or _values(found.get(_V_KV_OLD))
    else:
        found = _samples(data, _SGLANG)
        waiting = _values(found.get(_S_WAITING))
        running = _values(found.get(_S_RUNNING))
        kv = _values(found.get(_S_KV))
    if not (waiting or running or kv):
        raise MetricsError("no known load metric (vllm:num_requests_* / sglang:num_*_reqs)")

    block_size = blocks = None
    for rest in found.get(_V_CACHE_CONFIG, ()):
        raw = _split(rest)[0]
        block_size = _int_label(raw, b"block_size") or block_size
        n = _int_label(raw, b"num_gpu_blocks")
        if n is not None:
            blocks = (blocks or 0) + n

    max_adapters = None
    running_adapters: frozenset[str] = frozenset()
    waiting_adapters: frozenset[str] = frozenset()
    newest = -math.inf
    # One sample per adapter-set change, valued by its timestamp: the newest is current.
    for rest in found.get(_V_LORA, ()):
        raw, ts = _split(rest)
        if ts >= newest:
            newest = ts
            max_adapters = _int_label(raw, b"max_lora")
            running_adapters = _names(_label(raw, b"running_lora_adapters"))
            waiting_adapters = _names(_label(raw, b"waiting_lora_adapters"))

    process_start_s = None
    if (start := _START_FIRST.match(data) or _START.search(data)) is not None:
        try:
            process_start_s = float(start.group(1))
        except ValueError:
            raise MetricsError(f"bad process_start_time_seconds: {start.group(1)[:40]!r}") from None
    return Scraped(
        process_start_s=process_start_s,
        waiting=int(sum(waiting)),
        running=int(sum(running)),
        kv_usage=min(1.0, max(0.0, sum(kv) / len(kv))) if kv else 0.0,
        kv_block_size=block_size,
        kv_blocks=blocks,
        max_adapters=max_adapters,
        running_adapters=running_adapters,
        waiting_adapters=waiting_adapters,
        prefix_cache_queries=_counter(found, _V_QUERIES),
        prompt_tokens=_counter(found, _V_PROMPT_TOKENS),
        prefix_cache_hits=_counter(found, _V_HITS),
        latency=_latency(found),
        finished=_finished(found),
    )
