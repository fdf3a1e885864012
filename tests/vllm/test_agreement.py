"""Predictions against the real engine, on one mixed trace (tests/vllm/trace.py) sent through
Envoy and `extproc serve` to two vLLM servers with a 40-block cache (the trace evicts), with
a restart of one server half-way:

- precise mode: for every request, the cached tokens extproc predicts for the endpoint it
  chose equal vLLM's own `usage.prompt_tokens_details.cached_tokens` (>= 99%);
- the simulator, given each server's share of the same requests in the same order (and the
  restart), reports the same cached tokens per request as vLLM did;
- approximate mode (its keys calibrated from the engines' metrics) is measured on a second
  trace and its figure printed: it cannot be exact, the figure says how far it is.
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import random
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
import orjson
import pytest
import yaml

from extproc import protocol
from extproc.sim.engine import EngineSettings
from extproc.sim.server import ServerSettings, SimServer
from extproc.sim.timing import TimingSettings
from extproc.sim.tokens import SimTokenizer
from extproc.stack import Stack, StackOptions
from tests.vllm import trace as tr
from tests.vllm.conftest import (
    EXPLAIN_TOKEN,
    GPU_BLOCKS,
    MAX_MODEL_LEN,
    SCRAPE_INTERVAL_S,
    picker_config,
)
from tests.vllm.fleet import BLOCK_SIZE, VllmFleet

# KV events reach the picker asynchronously after the response: give them this long.
EVENT_SETTLE_S = 0.3
JSON = {"content-type": "application/json"}
RETRIED: list[str] = []  # requests sent twice after a 504 (printed with the figures)


@dataclass(frozen=True, slots=True)
class Sent:
    """One request as a server saw it (`kind` "restart" marks that server's restart)."""

    kind: str
    server: str
    path: str = ""
    body: bytes = b""
    predicted: int | None = None  # None: sent around the picker (warm-up)
    cached: int = 0


def picker_metrics(stack: Stack) -> dict[str, float]:
    text = httpx.get(f"http://127.0.0.1:{stack.picker_admin_port}/metrics", timeout=5).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def cached_tokens(r: httpx.Response) -> int:
    assert r.status_code == 200, r.text
    details = r.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def send(http: httpx.Client, entry: tr.Entry) -> list[Sent]:
    """The request and what it did; a 504 first adds a `lost` marker (see below)."""
    kind, path, body = entry
    out: list[Sent] = []
    raw = orjson.dumps(body)
    headers = {protocol.EXPLAIN_HEADER: EXPLAIN_TOKEN, **JSON}
    r = http.post(path, content=raw, headers=headers)
    if r.status_code == 504:
        # Envoy's ext_proc message timeout (200 ms) passed: a CPU-starved picker on a shared
        # machine, not a routing error. Sent again, once. The first attempt may still have
        # reached a server (the timeout can strike on the response headers), so from here
        # on no server's history is known for certain: the `lost` marker says so.
        RETRIED.append(kind)
        out.append(Sent("lost", "*"))
        r = http.post(path, content=raw, headers=headers)
    cached = cached_tokens(r)
    decision = json.loads(r.headers[protocol.DECISION_HEADER])
    out.append(
        Sent(kind, decision["endpoints"][0], path, raw, decision["predicted_cached_tokens"], cached)
    )
    return out


def warm(address: str, tag: str) -> Sent:
    """Each engine's first KV-event batch after a start is dropped by its connecting PUB
    socket; the picker recovers it by replay when the second arrives. One throwaway request
    per (re)started server (a prefix nothing shares) makes that happen before measuring."""
    _, path, body = tr.warmup(tag)
    raw = orjson.dumps(body)
    r = httpx.post(f"http://{address}{path}", content=raw, headers=JSON, timeout=120)
    return Sent("warmup", address, path, raw, None, cached_tokens(r))


def run(http: httpx.Client, entries: list[tr.Entry]) -> list[Sent]:
    out = []
    for entry in entries:
        out += send(http, entry)
        time.sleep(EVENT_SETTLE_S)
    return out


def wait_for(check, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"{what} within {timeout_s}s")


def report(mode: str, sent: list[Sent], seconds: float) -> tuple[float, str]:
    routed = [s for s in sent if s.predicted is not None]
    exact = sum(1 for s in routed if s.predicted == s.cached)
    near = sum(1 for s in routed if abs(s.predicted - s.cached) <= BLOCK_SIZE)  # type: ignore[operator]
    hits = sum(1 for s in routed if s.cached)
    by_kind: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for s in routed:
        by_kind[s.kind][0] += s.predicted == s.cached
        by_kind[s.kind][1] += 1
    figure = exact / len(routed)
    line = (
        f"{mode} agreement with vLLM: {exact}/{len(routed)} = {figure:.1%} exact, "
        f"{near / len(routed):.1%} within one block ({hits} requests with a hit; per kind "
        + ", ".join(f"{k} {a}/{n}" for k, (a, n) in sorted(by_kind.items()))
        + f"; {seconds:.0f}s; {len(RETRIED)} retried after a 504 so far)"
    )
    out = os.environ.get("EXTPROC_VLLM_RESULTS")
    if out:
        with open(out, "a") as f:
            rows = [{"kind": s.kind, "predicted": s.predicted, "cached": s.cached} for s in routed]
            f.write(json.dumps({"mode": mode, "line": line, "results": rows}) + "\n")
    return figure, line


@pytest.fixture(scope="module")
def precise_run(vllm_stack: Stack, vllm_fleet: VllmFleet) -> Iterator[tuple[list[Sent], dict]]:
    """The trace in precise mode: what every server saw, in order, and the picker's metrics."""
    started = time.monotonic()
    sent = [warm(srv.address, srv.address) for srv in vllm_fleet.servers]
    with httpx.Client(base_url=vllm_stack.url, timeout=120) as http:
        sent += run(http, tr.trace(phase="a"))

        # Restart server 0: the picker must forget what it held within a scrape interval.
        key = 'extproc_endpoint_cache_invalidations_total{reason="restart"}'
        before = picker_metrics(vllm_stack).get(key, 0)
        restarted = vllm_fleet.servers[0]
        restarted.restart()
        sent.append(Sent("restart", restarted.address))
        wait_for(
            lambda: picker_metrics(vllm_stack).get(key, 0) > before,
            timeout_s=10 * SCRAPE_INTERVAL_S + 5,
            what="the restart invalidated the endpoint",
        )
        sent.append(warm(restarted.address, "restart"))
        rng = random.Random(1313)
        again = [e for e in tr.trace(phase="a") if e[0] in ("chat", "completion")]
        sent += run(http, tr.interleave(rng, tr.trace(phase="b"), rng.sample(again, 20)))
    metrics = picker_metrics(vllm_stack)
    metrics["seconds"] = time.monotonic() - started
    # Every request as each server saw it, beside the servers' logs (kept): what an offline
    # comparison (e.g. of the simulator) needs.
    with open(vllm_fleet.servers[0].log_path.parent / "sent.jsonl", "w") as f:
        for s in sent:
            f.write(json.dumps({**asdict(s), "body": s.body.decode()}) + "\n")
    yield sent, metrics


def test_precise_predictions_equal_vllms_cached_tokens(
    precise_run: tuple[list[Sent], dict], vllm_fleet: VllmFleet, capsys
):
    sent, metrics = precise_run
    figure, line = report("precise", sent, metrics["seconds"])
    with capsys.disabled():
        print(f"\n{line}")
        for s in sent:
            if s.predicted is not None and s.predicted != s.cached:
                print(
                    f"  mismatch: {s.kind} on {s.server}: predicted {s.predicted}, got {s.cached}"
                )
    routed = [s for s in sent if s.predicted is not None]
    assert sum(1 for s in routed if s.cached) >= 20, f"the trace must exercise the cache: {line}"
    assert {s.server for s in routed} == set(vllm_fleet.addresses), "both servers used"
    assert metrics["extproc_kv_events_blocks_removed_total"] > 0, "the small cache evicted"
    assert figure >= 0.99, line


async def _simulate(sent: list[Sent], model_dir: str) -> list[tuple[Sent, int]]:
    """Each server's requests, in order, into a simulator shaped like it (block size 32, the
    same number of blocks); a restart is a fresh simulator."""
    tokenizer = SimTokenizer(Path(model_dir))
    engine = EngineSettings(
        model="tiny",
        block_size=BLOCK_SIZE,
        num_gpu_blocks=GPU_BLOCKS,
        max_model_len=MAX_MODEL_LEN,
        timing=TimingSettings(speed=1000.0),
    )
    out = []
    for server in dict.fromkeys(s.server for s in sent):
        mine = [s for s in sent if s.server == server]
        while mine:
            cut = next((i for i, s in enumerate(mine) if s.kind == "restart"), len(mine))
            async with (
                SimServer(ServerSettings(engine=engine), tokenizer) as sim,
                httpx.AsyncClient(base_url=sim.url, timeout=30) as http,
            ):
                for s in mine[:cut]:
                    r = await http.post(s.path, content=s.body, headers=JSON)
                    out.append((s, cached_tokens(r)))
            mine = mine[cut + 1 :]
    return out


def test_simulator_caches_what_vllm_cached(
    precise_run: tuple[list[Sent], dict], vllm_fleet: VllmFleet, capsys
):
    sent, _ = precise_run
    lost = next((i for i, s in enumerate(sent) if s.kind == "lost"), len(sent))
    if lost < 60:
        pytest.skip(f"a 504 after {lost} requests: too little known history to compare")
    pairs = asyncio.run(_simulate(sent[:lost], str(vllm_fleet.model_dir)))
    same = sum(1 for s, sim in pairs if sim == s.cached)
    with capsys.disabled():
        print(
            f"\nsimulator agreement with vLLM: {same}/{len(pairs)} requests, same cached "
            f"tokens ({len(sent) - lost} after a 504 not compared)"
        )
        for s, sim in pairs:
            if sim != s.cached:
                print(f"  differs: {s.kind} on {s.server}: vLLM {s.cached}, simulator {sim}")
    assert sum(1 for s, _ in pairs if s.cached) >= 20
    # Exact on the known history. Runs that differed (122/123, 121/123) mostly had 504s, whose
    # first attempts reached a server unseen by this comparison. Others, the simulator one
    # block above vLLM (a chat request: vLLM 64 cached tokens, simulator 96; 2-3 requests a run
    # once placements changed in the sixth session), came from vLLM's null block, which the
    # simulator's pool now keeps too (sim/cache.py): the two saved traces replay exact. One
    # difference is still tolerated.
    assert same >= len(pairs) - 1, f"{same}/{len(pairs)}"


def _approximate(
    fleet: VllmFleet, folder, *, calibrate: bool, seed: int
) -> tuple[list[Sent], float, dict]:
    """A picker without KV events or tokenizer (keys from its own decisions) on a trace
    nothing has cached yet; returns what was sent, the seconds, and the picker's metrics."""
    cfg = picker_config(fleet, folder / "picker.yaml")
    doc = yaml.safe_load(cfg.read_text())
    doc["index"] = {}
    doc["parse"] = {"calibrate": calibrate}
    cfg.write_text(yaml.safe_dump(doc))
    opts = StackOptions(fleet=fleet, extproc_args=("--config", str(cfg)), allow_explain=True)  # type: ignore[arg-type]
    started = time.monotonic()
    with Stack(opts) as stack:
        if calibrate:
            wait_for(
                lambda: picker_metrics(stack).get("extproc_approx_block_tokens") == BLOCK_SIZE,
                timeout_s=10,
                what="approximate keys took the engines' block size",
            )
        with httpx.Client(base_url=stack.url, timeout=120) as http:
            sent = run(http, tr.trace(seed=seed, phase="approx"))
        metrics = picker_metrics(stack)
    return sent, time.monotonic() - started, metrics


def test_approximate_agreement_is_measured(
    precise_run, vllm_fleet: VllmFleet, tmp_path_factory, capsys
):
    """Approximate mode, calibrated from the engines' metrics: its figure is printed (it
    cannot be exact), and its keys must have taken the engines' block size.
    EXTPROC_VLLM_BASELINE=1 also measures it uncalibrated (for bench/RESULTS.md)."""
    runs = [("approximate (calibrated)", True, 31)]
    if os.environ.get("EXTPROC_VLLM_BASELINE") == "1":
        runs.append(("approximate (uncalibrated)", False, 37))
    for mode, calibrate, seed in runs:
        folder = tmp_path_factory.mktemp("approx")
        sent, seconds, metrics = _approximate(vllm_fleet, folder, calibrate=calibrate, seed=seed)
        _, line = report(mode, sent, seconds)
        bpt = metrics["extproc_approx_bytes_per_token"]
        with capsys.disabled():
            print(
                f"\n{line} (block tokens {metrics['extproc_approx_block_tokens']:g}, "
                f"bytes per token {bpt:g})"
            )
        assert any(s.cached for s in sent)
