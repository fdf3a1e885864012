"""What the calibration e2e tests share: simulated servers large enough that nothing is
evicted, text of random syllables (the simulator's tokenizer averages ~1.3 characters per
token on it, far from the picker's configured bytes per token) sent as a streamed chat
request, and a gauge read off /metrics."""

from __future__ import annotations

import random
import re

from extproc.sim.workload import WorkItem

# Caches large enough that nothing is evicted: the tests are about the picker's keys and
# estimates, not LRU.
SIM = ("--fast", "10", "--prefill-tps", "50000", "--num-gpu-blocks", "20000",
       "--max-model-len", "16384", "--seed", "3")  # fmt: skip
_SYL = ("ka", "lo", "mi", "ne", "ru", "ta", "vi", "so", "pe", "da", "zu", "ri", "mo", "fa")


def chat_item(index: int, text: str) -> WorkItem:
    """`text` as a streamed two-token chat request (usage included), the workload's `index`."""
    body = {
        "model": "tiny",
        "max_tokens": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
        "messages": [{"role": "user", "content": text}],
    }
    return WorkItem(index, 0, index, 0, 0, body)


def syllable_text(rng: random.Random, words: int) -> str:
    return " ".join(
        "".join(rng.choice(_SYL) for _ in range(rng.randint(1, 3))) for _ in range(words)
    )


def gauge(metrics: str, name: str) -> float | None:
    """The first sample of `name` (any labels) in a /metrics text, None when absent."""
    m = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", metrics, re.MULTILINE)
    return float(m.group(1)) if m else None
