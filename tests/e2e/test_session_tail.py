"""A chat's next turn through Envoy and `extproc serve`, before and after its home server's
small KV cache turned over: while the index credits the home with the conversation, the
session-tail hysteresis keeps the turn there; once the capacity model has dropped it (other
tenants' prompts filled that cache), the turn has nothing cached to lose by moving and the
hysteresis lets go (issue 14: holding such turns home queued full recomputes behind that
server's work). Deterministic: the picker's own explanation is read, no timing."""

from __future__ import annotations

import random

import httpx

from extproc.stack import Stack, StackOptions
from tests.e2e.chat_turns import ChatTurns

# 64 blocks x 16 tokens per server: a few of the prompts below fill it.
SIM = ("--fast", "4", "--num-gpu-blocks", "64")
# The simulator's tokenizer averages ~1.3 bytes per token: told, as calibration would find
# (a change of keys mid-test would forget every prefix, which is not what this is about).
PARSE = "parse: {block_tokens: 16, bytes_per_token: 1}\n"
SCORER = "default/session-tail-scorer"  # the default profile's
WORDS = ("tenant", "policy", "invoice", "refund", "order", "ticket", "account", "shipping")


def text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat(system: str, *turns: str) -> dict:
    messages = [{"role": "system", "content": system}]
    for i, t in enumerate(turns):
        messages.append({"role": "assistant" if i % 2 else "user", "content": t})
    return {"model": "tiny", "messages": messages, "max_tokens": 2}


def test_the_tail_hysteresis_holds_while_cached_and_lets_go_once_evicted(tmp_path):
    rng = random.Random(5)
    system = "tenant zero. " + text(rng, 60)
    q1, a1, q2 = text(rng, 12), text(rng, 12), text(rng, 12)
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(PARSE)
    opts = StackOptions(upstreams=2, sim_args=SIM, extproc_args=("--config", str(cfg)))
    with Stack(opts) as stack, httpx.Client(timeout=60) as http:
        turns = ChatTurns(http, stack)
        send, explain = turns.send, turns.explain

        # The conversation's first turn; its next turn is explained, never sent.
        send(chat(system, q1))
        turn2 = chat(system, q1, a1, q2)
        before = explain(turn2)
        home = max(before["prefix_blocks"], key=before["prefix_blocks"].get)
        other = next(a for a in before["scores"][SCORER] if a != home)
        assert before["scores"][SCORER] == {home: 1.0, other: 0.0}, before
        # Other tenants' prompts, spread over both servers as new prefixes: each about
        # half a server's cache, so the home's copy of the conversation is evicted, in the
        # engine and (the capacity model, which sizes the index from the scraped KV size
        # every 32 decisions) in the index.
        for i in range(40):
            send(chat(f"tenant {i + 1}. " + text(rng, 60), text(rng, 12)))
            after = explain(turn2)
            held = after["prefix_blocks"]
            # What every chat shares (the template's first block) may stay everywhere.
            if held.get(home, 0) <= held.get(other, 0):
                break
        else:
            raise AssertionError(f"the index still credits {home}: {after}")
        assert after["scores"][SCORER] == {home: 1.0, other: 1.0}, after
