"""A deterministic request trace that exercises what decides vLLM's prefix-cache hits:
chats and completions sharing prefixes, block-aligned prompts, the request options that
change tokenization, cache salts, and (with a small KV cache) eviction.

Each entry is `(kind, path, body)`; `kind` names the case, for per-kind agreement figures.
"""

from __future__ import annotations

import random
from typing import Any

_SUBJECTS = ("the router", "a server", "the cache", "my friend", "the model", "our team")
_VERBS = ("sends", "reads", "stores", "routes", "computes", "evicts", "finds", "writes")
_OBJECTS = ("the prefix", "a token", "many blocks", "the answer", "some data", "a story")
_EXTRAS = ("today", "quickly", "again", "in the morning", "with care", "at night", "on time")

Entry = tuple[str, str, dict[str, Any]]
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _sentences(rng: random.Random, n: int) -> str:
    out = []
    for _ in range(n):
        s = f"{rng.choice(_SUBJECTS)} {rng.choice(_VERBS)} {rng.choice(_OBJECTS)}"
        out.append(f"{s.capitalize()} {rng.choice(_EXTRAS)}.")
    return " ".join(out)


def _chat(messages: list[dict[str, str]], **options: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": messages, "max_tokens": 1, **options}


def _completion(prompt: str | list[int], **options: Any) -> dict[str, Any]:
    return {"model": "tiny", "prompt": prompt, "max_tokens": 1, **options}


def conversations(rng: random.Random, n: int, turns: int, tag: str) -> list[Entry]:
    """`n` conversations sharing one system prompt, their turns interleaved."""
    system = {"role": "system", "content": f"{tag}. " + _sentences(rng, 6)}
    histories: list[list[dict[str, str]]] = [[system] for _ in range(n)]
    out: list[Entry] = []
    for turn in range(turns):
        for c, h in enumerate(histories):
            if turn:
                h.append({"role": "assistant", "content": _sentences(rng, 1)})
            h.append({"role": "user", "content": f"Chat {c}: " + _sentences(rng, 2)})
            out.append(("chat", CHAT, _chat(list(h))))
    return out


def documents(rng: random.Random, n: int, questions: int, tag: str) -> list[Entry]:
    """`n` documents, each asked `questions` different questions (completions)."""
    out: list[Entry] = []
    docs = [f"{tag} document {d}. " + _sentences(rng, rng.randint(8, 22)) for d in range(n)]
    for q in range(questions):
        for doc in docs:
            out.append(("completion", COMPLETIONS, _completion(f"{doc}\nQuestion {q}: ")))
    return out


def block_aligned(rng: random.Random) -> list[Entry]:
    """Token-id prompts of exactly 2, 3 and 4 blocks of 32, each sent twice: the engine
    never serves the last token from cache, so the repeat hits one block less."""
    out: list[Entry] = []
    for blocks in (2, 3, 4):
        ids = [rng.randrange(5, 460) for _ in range(32 * blocks)]
        out += [("block-aligned", COMPLETIONS, _completion(ids))] * 2
    return out


def options(rng: random.Random) -> list[Entry]:
    """Request options that change the token ids, each repeated so the repeat can hit."""
    text = "Options. " + _sentences(rng, 12)
    base = [{"role": "system", "content": "Options chat. " + _sentences(rng, 8)}]
    user = [*base, {"role": "user", "content": _sentences(rng, 3)}]
    cont = [*user, {"role": "assistant", "content": "The answer is that " + _sentences(rng, 2)}]
    out: list[Entry] = []
    for _ in range(2):
        out.append(("no-special-tokens", COMPLETIONS, _completion(text, add_special_tokens=False)))
    out.append(("special-tokens", COMPLETIONS, _completion(text)))
    for _ in range(2):
        out.append(("chat-special-tokens", CHAT, _chat(user, add_special_tokens=True)))
    for _ in range(2):
        out.append(("no-generation-prompt", CHAT, _chat(user, add_generation_prompt=False)))
    out.append(("chat", CHAT, _chat(user)))
    for _ in range(2):
        out.append(
            (
                "continue-final-message",
                CHAT,
                _chat(cont, continue_final_message=True, add_generation_prompt=False),
            )
        )
    return out


def salts(rng: random.Random) -> list[Entry]:
    doc = "Salted. " + _sentences(rng, 14)
    return [
        ("cache-salt", COMPLETIONS, _completion(doc, cache_salt="tenant-a")),
        ("cache-salt", COMPLETIONS, _completion(doc, cache_salt="tenant-a")),
        ("cache-salt", COMPLETIONS, _completion(doc, cache_salt="tenant-b")),
        ("cache-salt", COMPLETIONS, _completion(doc)),
        ("cache-salt", CHAT, _chat([{"role": "user", "content": doc}], cache_salt="tenant-a")),
        ("cache-salt", CHAT, _chat([{"role": "user", "content": doc}], cache_salt="tenant-a")),
    ]


def interleave(rng: random.Random, *parts: list[Entry]) -> list[Entry]:
    """Merge the parts in a random order that keeps each part's own order."""
    queues = [list(p) for p in parts if p]
    out: list[Entry] = []
    while queues:
        q = rng.choice(queues)
        out.append(q.pop(0))
        if not q:
            queues.remove(q)
    return out


def trace(seed: int = 13, *, phase: str = "a") -> list[Entry]:
    """One phase of the agreement trace (~70 requests)."""
    rng = random.Random(f"{seed}-{phase}")
    return interleave(
        rng,
        conversations(rng, 4, 4, f"Phase {phase}"),
        documents(rng, 4, 3, f"Phase {phase}"),
        block_aligned(rng),
        options(rng),
        salts(rng),
    )


def warmup(tag: str) -> Entry:
    """A throwaway request with a prefix no trace entry shares."""
    return ("warmup", COMPLETIONS, _completion(f"Warm-up {tag}. " + "x" * 80))
