"""A prompt extending a remembered one is encoded only past their common part, with exactly
the tokens a whole encode gives (precise keys must equal the engine's), or encoded whole
when the reuse check fails."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from extproc.hashing import token_prefixes
from extproc.hashing.token_prefixes import MAX_ENTRIES, TokenPrefixes
from extproc.stack import SIM_TOKENIZER_DIR

# The real-vLLM tier's model, when this machine has fetched it (tests/vllm).
VLLM_TINY = Path.home() / ".cache/extproc/vllm-tiny-model"
TOKENIZERS = [SIM_TOKENIZER_DIR] + ([VLLM_TINY] if (VLLM_TINY / "tokenizer.json").exists() else [])
WORDS = ("tool", "call", "result:", "error", "ok.", "{\"a\": 1}", "naïve", "日本語", "   ",
         "\n", "don't", "x=1;", "→", "emoji 🙂", "path/to/file.py", "12345", "—", "\t")  # fmt: skip


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def plain(tok: Tokenizer):
    def encode(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        enc = tok.encode(text, add_special_tokens=False)
        return enc.ids, enc.offsets

    return encode


@pytest.mark.parametrize("folder", TOKENIZERS, ids=lambda p: Path(p).name)
def test_growing_sessions_get_exactly_the_whole_encodes_tokens(folder):
    tok = Tokenizer.from_file(str(Path(folder) / "tokenizer.json"))
    rng = random.Random(11)
    encoded: list[int] = []
    inner = plain(tok)

    def counting(text: str):
        encoded.append(len(text))
        return inner(text)

    tp = TokenPrefixes(counting)
    shared = "<|system|>\nYou are an agent. " + words(rng, 300)
    sessions = [shared + f"\n<|user|>\ntask {s}: " + words(rng, 40) for s in range(4)]
    for _turn in range(8):
        for s in range(4):
            # The next turn: the previous text whole, then an answer and a tool result; now
            # and then a turn ends right where the last one did (no new text at all).
            if rng.random() < 0.9:
                sessions[s] += "\n<|assistant|>\n" + words(rng, rng.randint(1, 60))
            text = sessions[s] + "\n<|assistant|>\n"
            encoded.clear()
            assert tp.ids(text) == tok.encode(text, add_special_tokens=False).ids
            if _turn:
                # Only the new part and a margin before it were encoded, not the session.
                assert sum(encoded) < len(text) // 2, (encoded, len(text))
    assert tp.hits >= 28 and tp.misses == 0


def test_a_failed_check_encodes_the_whole_text():
    # An encoder that starts every encode with a marker token (as a tokenizer adding a
    # prefix space or a BOS to every text would): a tail encoded alone differs.
    def marked(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return [0] + [ord(c) for c in text], [(0, 0)] + [(i, i + 1) for i in range(len(text))]

    tp = TokenPrefixes(marked)
    first = "a" * 3000
    assert tp.ids(first) == marked(first)[0]
    second = first + "b" * 500
    assert tp.ids(second) == marked(second)[0]
    assert (tp.hits, tp.misses) == (0, 1)


def test_memory_is_bounded(monkeypatch):
    monkeypatch.setattr(token_prefixes, "MAX_TOKENS", 50_000)
    calls = []

    def chars(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        calls.append(text)
        return [ord(c) for c in text], [(i, i + 1) for i in range(len(text))]

    tp = TokenPrefixes(chars)
    for i in range(3 * MAX_ENTRIES):
        tp.ids(f"{i:05d} " + "z" * 1500)  # distinct beginnings: nothing to reuse
    assert len(tp._entries) <= MAX_ENTRIES
    assert sum(len(e.ids) for e in tp._entries.values()) <= 50_000
    assert sum(len(v) for v in tp._by_probe.values()) == len(tp._entries)
    # Short texts are encoded and not remembered.
    before = len(tp._entries)
    tp.ids("short")
    assert len(tp._entries) == before


def test_a_turn_holding_a_remembered_one_whole_replaces_it():
    def chars(text: str) -> tuple[list[int], list[tuple[int, int]]]:
        return [ord(c) for c in text], [(i, i + 1) for i in range(len(text))]

    tp = TokenPrefixes(chars)
    session = "agent prompt " * 100
    other = "another session " * 100
    tp.ids(other)
    for turn in range(10):
        session += f" turn {turn}: " + "y" * 200
        assert tp.ids(session) == chars(session)[0]
    # One entry per session, the latest turn's; a sibling that shares only a beginning (a
    # branch, not an extension) stays beside it.
    assert sorted(len(e.text) for e in tp._entries.values()) == [len(other), len(session)]
    assert tp._tokens == len(other) + len(session)
    branch = session[:-100] + "z" * 300
    tp.ids(branch)
    assert len(tp._entries) == 3
    assert sum(len(v) for v in tp._by_probe.values()) == len(tp._entries)
