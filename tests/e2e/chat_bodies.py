"""Chat requests for the e2e tests: ones that share no prefix with one another (flow-control
tests count every token of them as uncached work), the prompt tokens the picker estimates for
one, and a session's turns after a system prompt built from a few business words."""

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


WORDS = ("tenant", "policy", "invoice", "refund", "order", "ticket", "account", "shipping")


def text(rng: random.Random, words: int) -> str:
    """`words` of `WORDS`, drawn by `rng`."""
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(system: str, *turns: str, max_tokens: int = 2, stream: bool = False) -> dict:
    """A chat body for the simulator's `tiny` model: `system`, then the turns alternating
    user and assistant."""
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "assistant" if i % 2 else "user", "content": t})
    return {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "stream": stream}
