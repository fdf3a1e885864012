"""`/metrics` speaks vLLM 0.32's names, types and labels (captured scrape in fixtures)."""

from __future__ import annotations

import re
from pathlib import Path

import aiohttp

from tests.sim.conftest import StartSim

CAPTURED = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu" / "metrics.txt"
TEXT = "The router sends the prefix to the server today. The cache stores many blocks. " * 3


def parse(text: str) -> tuple[dict[str, str], dict[str, set[str]], dict[str, float]]:
    """(TYPE by family, label names by sample name, value of unlabelled-by-reason samples)."""
    types: dict[str, str] = {}
    labels: dict[str, set[str]] = {}
    values: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ")
            types[name] = kind
        elif line and not line.startswith("#"):
            m = re.match(r"([^{ ]+)(?:\{(.*)\})? (\S+)$", line)
            assert m, line
            names = {kv.split("=")[0] for kv in re.findall(r'(\w+)="', m.group(2) or "")}
            labels[m.group(1)] = names
            values[m.group(1)] = float(m.group(3))
    return types, labels, values


async def scrape(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(f"{url}/metrics") as resp:
        assert resp.status == 200
        assert resp.headers["content-type"].startswith("text/plain")
        return await resp.text()


async def test_metric_names_types_and_labels_match_captured_scrape(start_sim: StartSim):
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        text = await scrape(http, srv.url)
    real_types, real_labels, _ = parse(CAPTURED.read_text())
    types, labels, _ = parse(text)
    for name in (
        "vllm:num_requests_waiting",
        "vllm:num_requests_running",
        "vllm:kv_cache_usage_perc",
        "vllm:cache_config_info",
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:time_to_first_token_seconds",
    ):
        assert name in types, name
    for name, kind in types.items():
        assert real_types.get(name) == kind, name
    for sample, names in labels.items():
        assert names <= real_labels[sample], sample
    assert {"block_size", "num_gpu_blocks"} <= labels["vllm:cache_config_info"]


async def test_prefix_cache_counters_count_tokens(start_sim: StartSim):
    async with start_sim(events=False) as srv, aiohttp.ClientSession() as http:
        body = {"model": "tiny", "prompt": TEXT, "max_tokens": 1}
        for _ in range(2):
            async with http.post(f"{srv.url}/v1/completions", json=body) as resp:
                usage = (await resp.json())["usage"]
        _, _, values = parse(await scrape(http, srv.url))
    prompt = usage["prompt_tokens"]
    assert values["vllm:prefix_cache_queries_total"] == 2 * prompt
    assert values["vllm:prefix_cache_hits_total"] == (prompt - 1) // 16 * 16
    assert usage["prompt_tokens_details"]["cached_tokens"] == (prompt - 1) // 16 * 16
    assert values["vllm:time_to_first_token_seconds_count"] == 2
