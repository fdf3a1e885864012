"""Chat requests that share no prefix with one another (flow-control tests count every token
of them as uncached work), and the prompt tokens the picker estimates for one."""

from __future__ import annotations

import json
import random

from extproc.requests import ParseSettings, parse_request

PATH = "/v1/chat/completions"


def distinct_chat(
    model: str, seed: int, max_tokens: int, *, words: int = 250, stream: bool = True
) -> dict:
    """`words` random seven-letter words from `seed`: two seeds share no block."""
    rng = random.Random(seed)
    text = " ".join("".join(rng.choice("abcdefghij") for _ in range(7)) for _ in range(words))
    return {
        "model": model,
        "messages": [{"role": "user", "content": text}],
        "max_tokens": max_tokens,
        "stream": stream,
    }


def estimated_prompt_tokens(body: dict) -> int:
    """What a picker with default parse settings (calibration off) counts for `body`."""
    raw = json.dumps(body).encode()
    return parse_request(PATH, {}, raw, ParseSettings()).prompt_tokens
