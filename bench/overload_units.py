"""Per tenant of bench/bench_overload.py: the picker's token count per engine KV token, with
outputs counted as real tokens (what the picker did before `output_token_scale`) and scaled
by the prompt estimate's ratio (`-os` runs). Offline: the bench's own request bodies, the
picker's estimate and the simulator's tokenizer and chat template, no servers.

    .venv/bin/python bench/overload_units.py [--n 200]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_overload import KV_BLOCK, OUTPUT_TOKENS, PROMPT_WORDS, estimate_tokens, prompt

from extproc.requests import parse_request
from extproc.requests.settings import ParseSettings
from extproc.sim.tokens import SimTokenizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200, help="bodies per tenant")
    n = ap.parse_args().n
    tok = SimTokenizer()
    rows = {}
    for tenant, words in PROMPT_WORDS.items():
        est, eng, kv = [], [], []
        for i in range(n):
            body = {"model": "tiny", "stream": True, "stream_options": {"include_usage": True},
                    "messages": [{"role": "user", "content": prompt(random.Random(i), words)}],
                    "max_tokens": OUTPUT_TOKENS}  # fmt: skip
            req = parse_request("/v1/chat/completions", {}, json.dumps(body).encode(),
                                ParseSettings(bytes_per_token=1))  # fmt: skip
            est.append(estimate_tokens(body))
            eng.append(len(tok.prompt_tokens(req.prompt).ids))
            kv.append(-(-(eng[-1] + OUTPUT_TOKENS) // KV_BLOCK) * KV_BLOCK)
        rows[tenant] = (sum(est) / n, sum(eng) / n, sum(est) / sum(eng), sum(kv))
    scale = sum(r[0] for r in rows.values()) / sum(r[1] for r in rows.values())
    print(f"prompt estimate per engine prompt token (all tenants): {scale:.3f}")
    for tenant, (e, p, ratio, kv) in rows.items():
        plain = (e + OUTPUT_TOKENS) * n / kv
        scaled = (e + round(scale * OUTPUT_TOKENS)) * n / kv
        print(f"{tenant}: prompt estimate {e:.0f}, engine prompt {p:.0f} ({ratio:.3f}); per "
              f"engine KV token, outputs as tokens {plain:.3f}, scaled {scaled:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
