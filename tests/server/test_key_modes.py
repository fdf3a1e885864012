"""Each mode computes only the keys it routes on: precise mode never runs the approximate
canonical stream and hasher, approximate mode never runs the tokenizer. Through the picker's
real gRPC port (parse, lookup, schedule, record)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import orjson
import pytest

from extproc.config import Settings
from extproc.endpoints import parse_endpoints
from extproc.hashing import tokenizer
from extproc.hashing.tokenizer import PreciseSettings
from extproc.requests import parse
from extproc.server.app import App
from extproc.testing import ExtProcClient, body_chunks, post, request_headers

TOKENIZER = Path(__file__).parent.parent / "fixtures" / "vllm-0.32-cpu" / "tokenizer"
CHAT = orjson.dumps(
    {"model": "tiny", "messages": [{"role": "user", "content": "a shared prefix " * 200}]}
)


def counting(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str) -> list[int]:
    """Wraps `owner.name` so that its calls are counted (in the returned one-item list)."""
    calls = [0]
    real: Callable[..., Any] = getattr(owner, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, wrapper)
    return calls


async def route_one(settings: Settings) -> App:
    async with App(settings, parse_endpoints(",".join(settings.endpoints))) as app:
        async with ExtProcClient(f"127.0.0.1:{app.port}") as c:
            out = await c.exchange(
                [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
            )
        assert out, "no reply from the picker"
        return app


async def test_precise_mode_does_not_compute_approximate_keys(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    approx_stream = counting(monkeypatch, parse, "canonical_stream")
    approx_hash = counting(monkeypatch, parse, "block_keys")
    precise = counting(monkeypatch, tokenizer.PreciseKeys, "prompt_keys")
    s = msgspec.structs.replace(
        settings,
        parse=msgspec.structs.replace(
            settings.parse,
            precise=PreciseSettings(tokenizer_dir=str(TOKENIZER), model="tiny", block_size=16),
        ),
    )
    app = await route_one(s)
    assert precise[0] == 1
    assert approx_stream[0] == 0 and approx_hash[0] == 0
    # The request was routed on the tokenizer's keys (~600 tokens: dozens of 16-token blocks).
    assert app.router.stats.decisions == 1
    assert app.router.stats.prefix_blocks_requested >= 20


async def test_approximate_mode_does_not_run_the_tokenizer(
    settings: Settings, monkeypatch: pytest.MonkeyPatch
) -> None:
    approx_hash = counting(monkeypatch, parse, "block_keys")
    precise = counting(monkeypatch, tokenizer.PreciseKeys, "prompt_keys")
    token_ids = counting(monkeypatch, tokenizer.PromptTokenizer, "token_ids")
    app = await route_one(settings)
    assert approx_hash[0] == 1
    assert precise[0] == 0 and token_ids[0] == 0
    assert app.router.stats.decisions == 1
    assert app.router.stats.prefix_blocks_requested >= 5
