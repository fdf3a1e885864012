"""Request parsing + hashing + estimation cost, as ratios to `json.loads` on the same bytes
measured in the same run (absolute times move with the machine; the ratios much less).

    uv run python bench/bench_parse.py [--repeat N]

Bodies: multi-turn chat text of 4 KB, 100 KB, 400 KB (~100k tokens) and 4 MB (~1M tokens),
and a chat turn with three 1280x720 images inline (JPEG-sized and PNG-sized payloads).
Targets (issue 3): <= 1 ms at 400 KB, <= 10 ms at 4 MB, <= 5 ms for the image body.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import random
import statistics
import struct
import time
import zlib
from collections.abc import Callable

import orjson

from extproc.requests import ParseSettings, parse_request

WORDS = (
    "the router sends prefix server cache stores many blocks quickly request reads answer",
    "again team computes metrics with care system routes long prompts by design evicts data",
)
VOCAB = [w for line in WORDS for w in line.split()]


def _text(rng: random.Random, size: int) -> str:
    words = []
    total = 0
    while total < size:
        w = rng.choice(VOCAB)
        words.append(w)
        total += len(w) + 1
    return " ".join(words)[:size]


def chat_body(size: int, seed: int = 1) -> bytes:
    """A system prompt, then user/assistant turns of ~2 KB (the last turn takes the rest)."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": _text(rng, min(2000, size // 4))}]
    body = {
        "model": "Qwen/Qwen2.5-7B-Instruct",
        "messages": messages,
        "stream": True,
        "max_tokens": 256,
        "temperature": 0.2,
    }
    turn = max(2000, size // 200)
    while (room := size - len(orjson.dumps(body)) - 40) > 0:
        role = "user" if len(messages) % 2 else "assistant"
        messages.append({"role": role, "content": _text(rng, min(turn, room))})
    return orjson.dumps(body)


def _png(width: int, height: int, payload: int) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    chunk = struct.pack(">I", 13) + b"IHDR" + ihdr + struct.pack(">I", zlib.crc32(b"IHDR" + ihdr))
    return b"\x89PNG\r\n\x1a\n" + chunk + os.urandom(payload)


def _jpeg(width: int, height: int, payload: int) -> bytes:
    app0 = b"\xff\xe0" + struct.pack(">H", 16) + b"JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00"
    sof = b"\xff\xc0" + struct.pack(">HBHHB", 11, 8, height, width, 1) + b"\x01\x11\x00"
    return b"\xff\xd8" + app0 + sof + b"\xff\xda\x00\x02" + os.urandom(payload)


def image_body(make: Callable[[int, int, int], bytes], payload: int, mime: str) -> bytes:
    parts: list[dict] = [{"type": "text", "text": "Compare these three frames."}]
    for _ in range(3):
        b64 = base64.b64encode(make(1280, 720, payload)).decode()
        parts.append({"type": "image_url", "image_url": {"url": f"data:{mime};base64,{b64}"}})
    body = {
        "model": "Qwen/Qwen2.5-VL-7B-Instruct",
        "messages": [{"role": "user", "content": parts}],
    }
    return orjson.dumps(body)


def best_ms(fn: Callable[[], object], repeat: int) -> float:
    """Median of `repeat` runs after a warm-up, in milliseconds."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - t0)
    return statistics.median(times) / 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=30)
    args = ap.parse_args()
    settings = ParseSettings()
    headers = {"x-request-id": "bench"}
    cases = [
        ("chat 4 KB", chat_body(4_000), 1.0),
        ("chat 100 KB", chat_body(100_000), 1.0),
        ("chat 400 KB", chat_body(400_000), 1.0),
        ("chat 4 MB", chat_body(4_000_000), 10.0),
        ("3x720p JPEG (~200 KB each)", image_body(_jpeg, 200_000, "image/jpeg"), 5.0),
        ("3x720p PNG (~1 MB each)", image_body(_png, 1_000_000, "image/png"), 5.0),
    ]
    print(
        f"{'body':<28} {'bytes':>9} {'json.loads':>10} {'orjson':>8} {'parse':>8} "
        f"{'parse/json':>10} {'blocks':>6} {'tokens':>8} {'target':>7}"
    )
    for name, body, target_ms in cases:
        t_json = best_ms(lambda b=body: json.loads(b), args.repeat)
        t_orjson = best_ms(lambda b=body: orjson.loads(b), args.repeat)
        t_parse = best_ms(
            lambda b=body: parse_request("/v1/chat/completions", headers, b, settings), args.repeat
        )
        req = parse_request("/v1/chat/completions", headers, body, settings)
        verdict = "ok" if t_parse <= target_ms else "MISS"
        print(
            f"{name:<28} {len(body):>9,} {t_json:>8.3f}ms {t_orjson:>6.3f}ms {t_parse:>6.3f}ms "
            f"{t_parse / t_json:>10.2f} {len(req.block_keys):>6} {req.prompt_tokens:>8,} "
            f"{verdict:>4} {target_ms:g}"
        )


if __name__ == "__main__":
    main()
