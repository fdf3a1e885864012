"""Seeded chat workloads with shared prefixes, and an open-loop client that measures them.

A workload is built from groups. Each group has a system prompt and a few small images; its
conversations share both. A conversation's turn k carries the whole conversation so far (user
turns and synthetic assistant replies), so each turn extends the previous one's prompt:

    group g:  system_g ─┬─ conv 0: [img?] q0 ─ a0 ─ q1 ─ a1 ─ q2   (turns 0, 1, 2)
                        └─ conv 1: [img?] q0 ─ a0 ─ q1 ...

The assistant replies are workload text, not the server's output: the schedule stays open
loop (a turn never waits for the previous answer) and the same seed gives the same bodies
byte for byte. Requests of all conversations are interleaved at random, each conversation's
turns in order, and sent at Poisson arrival times (`arrival_offsets`).

`run_open_loop` sends them (streaming, usage included) and records one `Result` per request:
status, the `x-served-by` endpoint, TTFT (first SSE chunk with a token), total time, prompt
and cached tokens; `summarize` turns results into the figures the demo and the benchmark print.
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import random
import struct
import time
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from extproc.protocol import PREDICTED_TTFT_HEADER
from extproc.sim import SERVED_BY_HEADER


@dataclass(frozen=True, slots=True)
class WorkloadSpec:
    """Shape of a workload. Sizes are in words of a made-up vocabulary; the sim's tokenizer
    turns one word into about 3 tokens (the results record real prompt tokens).

    `image_fraction`: share of conversations whose first user turn carries `images_per_request`
    of their group's `images_per_group` images (so images repeat within a group), each
    `image_px` square (a 448 px image is 256 tokens by the default Qwen-style estimate).
    `header_words`: a chat-template-like header every group shares before its own prompt
    (its first block(s) are the same for every tenant). `tenant_skew`: Zipf exponent of the
    groups' sizes (0: every group has `conversations_per_group`; 1: group g has about
    1/(g+1) of the conversations, same total).
    """

    groups: int = 8
    conversations_per_group: int = 4
    turns: int = 3
    system_words: int = 300
    question_words: int = 20
    answer_words: int = 20
    image_fraction: float = 0.0
    images_per_request: int = 1
    images_per_group: int = 2
    image_px: int = 448
    max_tokens: int = 16
    model: str = "tiny"
    seed: int = 0
    header_words: int = 0
    tenant_skew: float = 0.0


def _group_sizes(spec: WorkloadSpec) -> list[int]:
    if not spec.tenant_skew:
        return [spec.conversations_per_group] * spec.groups
    weights = [(g + 1) ** -spec.tenant_skew for g in range(spec.groups)]
    total = spec.conversations_per_group * spec.groups
    return [max(1, round(total * w / sum(weights))) for w in weights]


@dataclass(frozen=True, slots=True)
class WorkItem:
    """One request of a workload: `body` is the JSON to POST to /v1/chat/completions."""

    index: int
    group: int
    conversation: int  # global conversation number
    turn: int
    images: int
    body: dict[str, Any]


@dataclass(slots=True)
class Result:
    """What one request did. `ttft_s`/`total_s` are wall seconds from the send; `status` 0
    means the connection failed (then `error` says why)."""

    index: int
    status: int = 0
    served_by: str = ""
    ttft_s: float | None = None
    total_s: float = 0.0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    error: str = ""
    # The picker's predicted TTFT for this request (`x-extproc-predicted-ttft-ms`), if sent.
    predicted_ttft_s: float | None = None


@dataclass(frozen=True, slots=True)
class Summary:
    """Figures for one run. `hit_ratio`: cached prompt tokens / prompt tokens (successful
    requests); TTFT in seconds; throughput over the run's wall duration."""

    requests: int
    ok: int
    hit_ratio: float
    ttft_p50_s: float
    ttft_p90_s: float
    req_per_s: float
    output_tok_per_s: float
    duration_s: float
    per_endpoint: dict[str, int] = field(default_factory=dict)
    ttft_p99_s: float = float("nan")


_SYLLABLES = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "da", "zu", "ri", "mo", "fa")


def _vocabulary(rng: random.Random, size: int = 400) -> list[str]:
    words: set[str] = set()
    while len(words) < size:
        words.add("".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 3))))
    return sorted(words)


def _text(rng: random.Random, vocab: Sequence[str], words: int) -> str:
    return " ".join(rng.choice(vocab) for _ in range(words))


def png_data_uri(seed: int, px: int) -> str:
    """A small, valid `px` x `px` PNG whose pixels depend on `seed` (each row one seeded
    colour: compresses to a few hundred bytes, yet every seed hashes differently)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(px):
        rows.append(b"\x00" + bytes(rng.randrange(256) for _ in range(3)) * px)
    raw = zlib.compress(b"".join(rows), 9)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data))
            + kind
            + data
            + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)
        )

    png = (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", struct.pack(">IIBBBBB", px, px, 8, 2, 0, 0, 0))
        + chunk(b"IDAT", raw)
        + chunk(b"IEND", b"")
    )
    return "data:image/png;base64," + base64.b64encode(png).decode()


def build_workload(spec: WorkloadSpec) -> list[WorkItem]:
    """Every request of the workload in send order. Deterministic in `spec`."""
    rng = random.Random(spec.seed)
    vocab = _vocabulary(rng)
    convs: list[list[WorkItem]] = []
    conv_no = 0
    header = _text(rng, vocab, spec.header_words) + " " if spec.header_words else ""
    sizes = _group_sizes(spec)
    for g in range(spec.groups):
        # A group tag keeps two groups' prompts apart from the first block after the header.
        system = header + f"group {g} seed {spec.seed}. " + _text(rng, vocab, spec.system_words)
        images = [
            png_data_uri(spec.seed * 1_000_003 + g * 101 + i, spec.image_px)
            for i in range(spec.images_per_group if spec.image_fraction > 0 else 0)
        ]
        for _ in range(sizes[g]):
            with_images = images and rng.random() < spec.image_fraction
            picked = rng.sample(images, min(spec.images_per_request, len(images)))
            messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
            turns = []
            for t in range(spec.turns):
                question = _text(rng, vocab, spec.question_words) + "?"
                if t == 0 and with_images:
                    content: Any = [
                        *({"type": "image_url", "image_url": {"url": u}} for u in picked),
                        {"type": "text", "text": question},
                    ]
                else:
                    content = question
                messages.append({"role": "user", "content": content})
                body = {
                    "model": spec.model,
                    "messages": [dict(m) for m in messages],
                    "max_tokens": spec.max_tokens,
                    "stream": True,
                    "stream_options": {"include_usage": True},
                }
                n_img = len(picked) if with_images else 0
                turns.append(WorkItem(0, g, conv_no, t, n_img, body))
                messages.append(
                    {"role": "assistant", "content": _text(rng, vocab, spec.answer_words)}
                )
            convs.append(turns)
            conv_no += 1
    # Random interleave that keeps each conversation's turns in order: draw the next
    # conversation with probability proportional to its remaining turns.
    order: list[WorkItem] = []
    pending = [list(reversed(c)) for c in convs]
    remaining = [len(c) for c in pending]
    total = sum(remaining)
    while total:
        k = rng.choices(range(len(pending)), weights=remaining)[0]
        item = pending[k].pop()
        remaining[k] -= 1
        total -= 1
        order.append(
            WorkItem(len(order), item.group, item.conversation, item.turn, item.images, item.body)
        )
    return order


def arrival_offsets(n: int, rate_per_s: float, seed: int) -> list[float]:
    """Poisson arrivals: `n` send times (seconds from the start) at `rate_per_s` on average."""
    rng = random.Random(seed ^ 0x5EED)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate_per_s)
    return out


def _has_token(chunk: dict[str, Any]) -> bool:
    # A chat stream opens with an empty role chunk before prefill is done; TTFT is the
    # first chunk that carries generated text.
    for choice in chunk.get("choices") or ():
        if choice.get("text") or (choice.get("delta") or {}).get("content"):
            return True
    return False


async def send_one(
    session: aiohttp.ClientSession, url: str, item: WorkItem, timeout_s: float
) -> Result:
    """POST one streaming chat request to `url` (a base URL) and time it."""
    res = Result(item.index)
    start = time.perf_counter()
    try:
        async with session.post(
            f"{url}/v1/chat/completions",
            json=item.body,
            timeout=aiohttp.ClientTimeout(total=timeout_s),
        ) as resp:
            res.status = resp.status
            res.served_by = resp.headers.get(SERVED_BY_HEADER, "")
            predicted = resp.headers.get(PREDICTED_TTFT_HEADER)
            if predicted is not None:
                res.predicted_ttft_s = float(predicted) / 1000.0
            if resp.status != 200:
                res.error = (await resp.text())[:200]
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:"):
                        continue
                    data = line[5:].strip()
                    if data == b"[DONE]":
                        break
                    chunk = json.loads(data)
                    if res.ttft_s is None and _has_token(chunk):
                        res.ttft_s = time.perf_counter() - start
                    usage = chunk.get("usage")
                    if usage:
                        res.prompt_tokens = usage.get("prompt_tokens", 0)
                        res.completion_tokens = usage.get("completion_tokens", 0)
                        details = usage.get("prompt_tokens_details") or {}
                        res.cached_tokens = details.get("cached_tokens") or 0
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    res.total_s = time.perf_counter() - start
    return res


async def run_open_loop(
    items: Sequence[WorkItem],
    offsets: Sequence[float],
    target: str | Callable[[WorkItem], str],
    *,
    timeout_s: float = 120.0,
    on_done: Callable[[Result], None] | None = None,
) -> tuple[list[Result], float]:
    """Send `items[i]` at `offsets[i]` whatever the earlier ones are doing (open loop).
    `target` is a base URL or a function choosing one per request (a client-side router).
    Returns the results in item order and the wall duration (first send to last answer)."""
    connector = aiohttp.TCPConnector(limit=0, force_close=False)
    async with aiohttp.ClientSession(connector=connector) as session:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def fire(item: WorkItem, at: float) -> Result:
            delay = t0 + at - loop.time()
            if delay > 0:
                await asyncio.sleep(delay)
            url = target if isinstance(target, str) else target(item)
            res = await send_one(session, url, item, timeout_s)
            if on_done is not None:
                on_done(res)
            return res

        results = await asyncio.gather(*(fire(i, at) for i, at in zip(items, offsets, strict=True)))
        return list(results), loop.time() - t0


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100): the smallest value with at least q% of the
    values at or below it, the ceil(q/100 * n)-th; NaN for no values. (It once took
    `round(q/100 * n + 0.5)`, which Python's round-half-to-even made one rank too high
    whenever q/100 * n was an odd whole number: the p99 of 100 TTFTs was their maximum.)"""
    if not values:
        return float("nan")
    ordered = sorted(values)
    # The epsilon keeps a product that float arithmetic lands just above a whole number
    # (e.g. 99.9 * 1000 / 100) on that rank.
    rank = math.ceil(q * len(ordered) / 100 - 1e-9)
    return ordered[max(0, min(len(ordered) - 1, rank - 1))]


def summarize(results: Sequence[Result], duration_s: float) -> Summary:
    ok = [r for r in results if r.status == 200 and r.ttft_s is not None]
    prompt = sum(r.prompt_tokens for r in ok)
    per_endpoint: dict[str, int] = {}
    for r in ok:
        per_endpoint[r.served_by] = per_endpoint.get(r.served_by, 0) + 1
    ttfts = [r.ttft_s for r in ok if r.ttft_s is not None]
    return Summary(
        requests=len(results),
        ok=len(ok),
        hit_ratio=sum(r.cached_tokens for r in ok) / prompt if prompt else 0.0,
        ttft_p50_s=percentile(ttfts, 50),
        ttft_p90_s=percentile(ttfts, 90),
        req_per_s=len(ok) / duration_s if duration_s > 0 else 0.0,
        output_tok_per_s=sum(r.completion_tokens for r in ok) / duration_s if duration_s else 0.0,
        duration_s=duration_s,
        per_endpoint=dict(sorted(per_endpoint.items())),
        ttft_p99_s=percentile(ttfts, 99),
    )
