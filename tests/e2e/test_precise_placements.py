"""Precise mode through `extproc serve` behind Envoy, on simulated vLLM servers publishing KV
events: a prompt the picker has placed but its engine has not admitted yet (so not published)
counts on that endpoint for the next request sharing it (index/placed.py), and once the
engine publishes, the events alone carry the match.

Deterministic without timing margins that matter: every server admits one request at a time
(`--max-num-seqs 1`) and is busy decoding a slow blocker for seconds, so the placed prompt
waits in the engine's queue, unpublished, while the next request is decided."""

from __future__ import annotations

import asyncio
import json
import time

import aiohttp
import httpx
import yaml

from extproc.protocol import DECISION_HEADER, EXPLAIN_HEADER
from extproc.sim import SERVED_BY_HEADER
from extproc.stack import SimFleet, Stack, StackOptions

TOKEN = "precise-placements-token"
ENTRIES = "extproc_access_log_entries_total"
# Two servers, one sequence each, slow decode: a 40-token blocker holds a server ~2 s.
SIM = ("--max-num-seqs", "1", "--decode-tps", "20", "--prefill-tps", "20000",
       "--num-gpu-blocks", "2000")  # fmt: skip
SYSTEM = "You are the ledger assistant of tenant seven. " + " ".join(
    f"rule {i}: reconcile every entry against the journal before closing." for i in range(60)
)


def body(user: str, max_tokens: int, system: str = SYSTEM) -> dict:
    return {
        "model": "tiny",
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": max_tokens,
        "stream": True,
    }


async def post(http: aiohttp.ClientSession, url: str, payload: dict) -> tuple[str, dict | None]:
    """Sends one request to the end; (served by, decision explained)."""
    async with http.post(
        f"{url}/v1/chat/completions", json=payload, headers={EXPLAIN_HEADER: TOKEN}
    ) as resp:
        assert resp.status == 200, await resp.text()
        served = resp.headers.get(SERVED_BY_HEADER, "")
        raw = resp.headers.get(DECISION_HEADER)
        async for _ in resp.content:
            pass
        return served, json.loads(raw) if raw else None


def value(text: str, sample: str) -> float:
    """One sample's value from a Prometheus text page (`name{labels}` as exported)."""
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[-1])
    raise AssertionError(f"{sample} not exported")


async def scenario(url: str, admin: str) -> tuple[str, dict, dict]:
    async with aiohttp.ClientSession() as http:
        # The picker holds a placement to the request's end once the gateway's access log
        # is seen reporting ends (its default): one request to the end, its entry received.
        await post(http, url, body("warm up", 1, system="warm up"))
        deadline = time.monotonic() + 30
        while value(await (await http.get(admin)).text(), ENTRIES) < 1:
            assert time.monotonic() < deadline, "no access-log entry reached the picker"
            await asyncio.sleep(0.1)
        # One slow blocker per server (the second goes where the first is not: in flight).
        first = asyncio.create_task(post(http, url, body("block a", 40, system="blocker a")))
        await asyncio.sleep(0.3)
        second = asyncio.create_task(post(http, url, body("block b", 40, system="blocker b")))
        await asyncio.sleep(0.3)
        # Placed behind a blocker: queued in its engine, not published.
        placed = asyncio.create_task(post(http, url, body("close march", 4)))
        await asyncio.sleep(0.3)
        sharing = asyncio.create_task(post(http, url, body("close april", 4)))
        blockers = await asyncio.gather(first, second)
        where, _ = await placed
        _, decided = await sharing
        assert decided is not None
        # Every response is in and the engines have published: the events carry the match.
        await asyncio.sleep(0.5)
        _, after = await post(http, url, body("close may", 4))
        assert after is not None
        assert len({b[0] for b in blockers}) == 2, blockers
        return where, decided, after


def test_a_placed_prompt_counts_on_its_endpoint_before_its_engine_publishes_it(tmp_path):
    with SimFleet(2, SIM, log_dir=tmp_path) as fleet:
        cfg = fleet.precise_settings(f"tcp://127.0.0.1:{fleet.kv_events_port}")
        cfg["server"] = {"explain_tokens": [TOKEN]}
        path = tmp_path / "picker.yaml"
        path.write_text(yaml.safe_dump(cfg))
        opts = StackOptions(
            fleet=fleet, log_dir=tmp_path, extproc_args=("--config", str(path)),
            allow_explain=True,
        )  # fmt: skip
        with Stack(opts) as stack:
            time.sleep(0.5)  # the sims' PUB sockets reconnect to the picker's socket
            admin = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
            where, decided, after = asyncio.run(scenario(stack.url, admin))
            metrics = httpx.get(admin).text
    # The shared system prompt (dozens of blocks) was credited where it was placed, though
    # no engine had published a block of it. (Where the request went is the scorers' call:
    # waiting there behind the placed prompt costs about what recomputing it elsewhere does.)
    assert decided["prefix_blocks"].get(where, 0) >= 20, (where, decided)
    pending = 'extproc_precise_placement_corrections_total{kind="pending"}'
    assert value(metrics, pending) >= 1
    # Afterwards the engines' events alone say the same.
    assert value(metrics, "extproc_kv_events_blocks_stored_total") > 0
    assert after["prefix_blocks"].get(where, 0) >= 20, after
