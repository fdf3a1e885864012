"""Reading a `/metrics` body: a real vLLM scrape, SGLang, and the edge cases of the text
format (escapes, OpenMetrics, NaN, garbage)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from extproc.endpoints.exposition import LatencyTotals, MetricsError, Scraped, parse_metrics

FIXTURE = Path(__file__).parents[1] / "fixtures" / "vllm-0.32-cpu" / "metrics.txt"
VLLM = FIXTURE.read_bytes()

SGLANG = b"""\
# HELP sglang:num_running_reqs The number of running requests.
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{engine_type="unified",model_name="qwen",tp_rank="0"} 7.0
# HELP sglang:num_used_tokens The number of used tokens.
# TYPE sglang:num_used_tokens gauge
sglang:num_used_tokens{engine_type="unified",model_name="qwen",tp_rank="0"} 52110.0
# HELP sglang:token_usage The token usage.
# TYPE sglang:token_usage gauge
sglang:token_usage{engine_type="unified",model_name="qwen",tp_rank="0"} 0.42
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{engine_type="unified",model_name="qwen",tp_rank="0"} 3.0
# HELP sglang:cache_hit_rate The prefix cache hit rate.
# TYPE sglang:cache_hit_rate gauge
sglang:cache_hit_rate{engine_type="unified",model_name="qwen",tp_rank="0"} 0.61
"""


def vllm(*lines: str) -> bytes:
    return ("\n".join(lines) + "\n").encode()


def test_real_vllm_scrape_gives_load_cache_config_and_prefix_counters() -> None:
    assert parse_metrics(VLLM) == Scraped(
        waiting=0,
        running=0,
        kv_usage=0.0,
        kv_block_size=32,
        kv_blocks=65536,
        prefix_cache_queries=495,
        prefix_cache_hits=128,
        process_start_s=1.79597100344e09,
        prompt_tokens=495,
        latency=LatencyTotals(
            ttft_sum=2.0445685386657715,
            ttft_count=9.0,
            queue_sum=0.00021912600027462759,
            queue_count=9.0,
            prefill_sum=2.0158210619995316,
            prefill_count=9.0,
            itl_sum=0.10916207699983715,
            itl_count=47.0,
            tpot_sum=0.02088012846661513,
            tpot_count=9.0,
            prompt_sum=495.0,
            prompt_count=9.0,
            # The decode phases: first token to last (the inter-token gaps added up).
            decode_sum=0.10916207699983715,
            decode_count=9.0,
            prefill_tokens=367.0,
        ),
        # request_success_total over its five finish reasons (length 9, the others 0).
        finished=9,
    )


def test_latency_totals_fall_back_to_local_compute_tokens_and_old_tpot_name() -> None:
    """Without the kv-computed histogram, uncached tokens come from prompt_tokens_by_source;
    vLLM before 0.11 named TPOT time_per_output_token_seconds; no histogram at all: None."""
    got = parse_metrics(
        vllm(
            'vllm:num_requests_running{engine="0"} 1.0',
            'vllm:request_prefill_time_seconds_sum{engine="0"} 1.5',
            'vllm:request_prefill_time_seconds_count{engine="0"} 3.0',
            'vllm:time_per_output_token_seconds_sum{engine="0"} 0.2',
            'vllm:time_per_output_token_seconds_count{engine="0"} 4.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_compute"} 300.0',
            'vllm:prompt_tokens_by_source_total{engine="0",source="local_cache_hit"} 50.0',
        )
    ).latency
    assert got == LatencyTotals(
        prefill_sum=1.5, prefill_count=3.0, tpot_sum=0.2, tpot_count=4.0, prefill_tokens=300.0
    )
    assert parse_metrics(vllm('vllm:num_requests_running{engine="0"} 1.0')).latency is None


def test_real_vllm_scrape_with_load_agrees_with_a_generic_parser() -> None:
    """The fixture with nonzero figures and a second engine: sums and mean as
    prometheus_client reads the same text."""
    text = VLLM.decode()
    text = text.replace(
        'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_running{engine="0",model_name="tiny"} 5.0\n'
        'vllm:num_requests_running{engine="1",model_name="tiny"} 2.0',
    )
    text = text.replace(
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 0.0',
        'vllm:num_requests_waiting{engine="0",model_name="tiny"} 11.0\n'
        'vllm:num_requests_waiting{engine="1",model_name="tiny"} 4.0',
    )
    text = text.replace(
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0',
        'vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.75',
    )
    got = parse_metrics(text.encode())

    samples: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s.value)
    assert got.waiting == sum(samples["vllm:num_requests_waiting"]) == 15
    assert got.running == sum(samples["vllm:num_requests_running"]) == 7
    kv = samples["vllm:kv_cache_usage_perc"]
    assert got.kv_usage == pytest.approx(sum(kv) / len(kv)) == 0.5
    assert got.prefix_cache_queries == sum(samples["vllm:prefix_cache_queries_total"])


def test_sglang_names() -> None:
    got = parse_metrics(SGLANG)
    assert (got.waiting, got.running, got.kv_usage) == (3, 7, pytest.approx(0.42))
    assert got.kv_block_size is None and got.prefix_cache_queries is None


def test_older_vllm_cache_usage_name_is_read() -> None:
    got = parse_metrics(vllm("vllm:num_requests_waiting 1", "vllm:gpu_cache_usage_perc 0.3"))
    assert got.kv_usage == pytest.approx(0.3)


def test_current_cache_usage_name_wins_over_the_older_one() -> None:
    got = parse_metrics(vllm("vllm:gpu_cache_usage_perc 0.9", "vllm:kv_cache_usage_perc 0.2"))
    assert got.kv_usage == pytest.approx(0.2)


def test_lora_info_comes_from_the_newest_sample() -> None:
    got = parse_metrics(
        vllm(
            "vllm:num_requests_running 2",
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="old",'
            'waiting_lora_adapters=""} 1.7e9',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="sql, chat",'
            'waiting_lora_adapters="math"} 1.8e9',
            'vllm:lora_requests_info{max_lora="4",running_lora_adapters="older",'
            'waiting_lora_adapters=""} 1.6e9',
        )
    )
    assert got.max_adapters == 4
    assert got.running_adapters == {"sql", "chat"}
    assert got.waiting_adapters == {"math"}


def test_escaped_label_values_are_unescaped() -> None:
    """A read label value holding escapes (quote, backslash, newline) comes back unescaped
    (a bytes pattern's replacement must be bytes: this raised TypeError before)."""
    got = parse_metrics(
        vllm(
            "vllm:num_requests_running 1",
            'vllm:lora_requests_info{max_lora="2",'
            'running_lora_adapters="say \\"hi\\",back\\\\slash,new\\nline",'
            'waiting_lora_adapters=""} 1.8e9',
        )
    )
    assert got.running_adapters == {'say "hi"', "back\\slash", "new\nline"}


def test_cache_config_reads_exact_label_names_and_sums_blocks_over_engines() -> None:
    """`hash_block_size` and `mamba_block_size` are not `block_size`; an escaped quote in
    another label does not end the label set early."""
    got = parse_metrics(
        vllm(
            "vllm:num_requests_waiting 0",
            'vllm:cache_config_info{hash_block_size="None",note="say \\"hi\\", block_size=1",'
            'block_size="16",mamba_block_size="8",num_gpu_blocks="1000",engine="0"} 1.0',
            'vllm:cache_config_info{block_size="16",num_gpu_blocks="24",engine="1"} 1.0',
        )
    )
    assert (got.kv_block_size, got.kv_blocks) == (16, 1024)


def test_help_type_and_created_lines_are_not_samples() -> None:
    got = parse_metrics(
        vllm(
            "# HELP vllm:num_requests_waiting 99",
            "# TYPE vllm:num_requests_waiting gauge",
            'vllm:num_requests_waiting_by_reason{reason="capacity"} 50',
            "vllm:num_requests_waiting 3",
            "vllm:prefix_cache_hits_created 1.7e9",
            "vllm:prefix_cache_hits_total 10",
        )
    )
    assert got.waiting == 3 and got.prefix_cache_hits == 10


def test_openmetrics_body_with_timestamps_and_crlf() -> None:
    body = b"vllm:num_requests_running 4 1700000000\r\nvllm:num_requests_waiting 2\r\n# EOF\r\n"
    got = parse_metrics(body)
    assert (got.running, got.waiting) == (4, 2)


def test_nan_samples_are_ignored_and_kv_usage_is_clamped() -> None:
    got = parse_metrics(
        vllm(
            "vllm:num_requests_waiting NaN",
            "vllm:num_requests_running 1",
            "vllm:kv_cache_usage_perc 1.5",
        )
    )
    assert (got.waiting, got.running, got.kv_usage) == (0, 1, 1.0)
    assert not math.isnan(got.kv_usage)


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"<html><body>Not metrics</body></html>",
        b"# HELP vllm:num_requests_waiting only help\n",
        b"python_gc_objects_collected_total 1.0\n",
        b'vllm:num_requests_waiting{engine="0"} many\n',
        b'vllm:num_requests_waiting{engine="0" 1.0\n',
        b"\x00\xff\xfe garbage \x89PNG",
    ],
)
def test_unusable_bodies_raise_metrics_error(body: bytes) -> None:
    with pytest.raises(MetricsError):
        parse_metrics(body)


def test_process_start_time_on_the_first_line_or_later_and_not_inside_another_name() -> None:
    load = b"vllm:num_requests_waiting 1\n"
    first = b"process_start_time_seconds 1.5e+09\n" + load
    later = load + b"# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 2.5e+09\n"
    other = load + b"my_process_start_time_seconds 3.5e+09\n"
    assert parse_metrics(first).process_start_s == 1.5e09
    assert parse_metrics(later).process_start_s == 2.5e09
    assert parse_metrics(other).process_start_s is None
