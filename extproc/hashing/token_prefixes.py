"""Recently tokenized prompts, so a prompt that extends one of them is tokenized only past
the part they share.

Agentic and chat sessions resend their whole conversation every turn: a session's turn 12
holds turn 11 whole, 20,000 tokens and more, and tokenizing it took the picker ~10 ms of CPU
per decision in precise mode (issue 14: on the agentic workload precise mode's time outside
the engines was 0.07 s a request at the median, approximate mode's 0.025 s, with identical
placements). Here the new prompt's common prefix with a remembered one keeps that one's
tokens up to a token boundary well inside the common part, and only the rest is encoded.

Exactness. Tokens are cut at a boundary between two tokens at least `MARGIN` characters
before the texts diverge. The rest is encoded on its own, and its first tokens, those that
end before the divergence, must be exactly the remembered tokens at the same offsets: the
cut did not change how the text after it splits. The text before the cut, and `MARGIN`
characters after it, are the same in both prompts, so a tokenizer whose pre-tokenizer
decides a split from nearby characters (byte-level BPE's regex, whitespace and punctuation
splitters) splits it the same way. When the check fails (a normalizer, a prefix space added
at the start of every encode, a merge across the cut), the whole prompt is encoded, as
without this cache, and counted in `misses`.

Bounded: at most `MAX_ENTRIES` prompts and `MAX_TOKENS` tokens are remembered, the least
recently remembered go first (each encode remembers its prompt, so a live session's latest
turn stays). A prompt that holds a remembered one whole replaces it: the older turn's tokens
are all in the newer one, and a session's next turn extends its latest, so keeping every turn
would spend the budget on copies of one conversation. Thread-safe (a lock around the table;
encoding runs outside it).
"""

from __future__ import annotations

import bisect
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

# Characters between the cut and the point where the prompts diverge: tokens ending within
# them are re-encoded and checked against the remembered ones.
MARGIN = 64
# Prompts shorter than this are encoded whole (nothing worth remembering).
MIN_CHARS = 1024
# Prompts sharing their first this many characters are looked up together.
PROBE = 256
MAX_ENTRIES = 64
# A remembered token costs ~130 bytes (its id and offsets as Python objects: 259 MB for 2M
# tokens, measured); 512k tokens (~67 MB) hold 8 agentic sessions of 58k tokens each.
MAX_TOKENS = 512_000
# Remembered prompts compared per lookup (the most recent with the same beginning): 8
# sessions on one agent prompt share a beginning, a new session must still find its own.
MAX_CANDIDATES = 32
# Encodes an entry's offsets are kept as before they are flattened into one.
MAX_SEGMENTS = 64


class _Offsets:
    """Each token's (first character, end character), kept as the encodes produced them:
    segments of offsets relative to the character their encode started at. Extending a
    prompt adds one segment and copies nothing token by token (shifting 2,000 tail offsets
    in Python cost more than encoding them)."""

    __slots__ = ("_bases", "_firsts", "_segs")

    def __init__(self, segs: list[tuple[int, list[tuple[int, int]]]]) -> None:
        self._segs = [(base, rel) for base, rel in segs if rel]
        self._bases = [base for base, _ in self._segs]
        firsts, n = [], 0
        for _, rel in self._segs:
            firsts.append(n)
            n += len(rel)
        self._firsts = [*firsts, n]

    def __len__(self) -> int:
        return self._firsts[-1]

    def get(self, j: int) -> tuple[int, int]:
        i = bisect.bisect_right(self._firsts, j) - 1
        base, rel = self._segs[i]
        start, end = rel[j - self._firsts[i]]
        return base + start, base + end

    def ending_by(self, limit: int) -> int:
        """How many tokens end at or before character `limit` (ends never decrease)."""
        for i, (base, rel) in enumerate(self._segs):
            if base + rel[-1][1] > limit:
                inside = bisect.bisect_right(rel, limit - base, key=lambda o: o[1])
                return self._firsts[i] + inside
        return len(self)

    def extended(self, k: int, base: int, rel: list[tuple[int, int]]) -> _Offsets:
        """The first `k` tokens' offsets, then `rel` from character `base` on."""
        segs = []
        for i, (b, r) in enumerate(self._segs):
            first = self._firsts[i]
            if first >= k:
                break
            segs.append((b, r if first + len(r) <= k else r[: k - first]))
        if len(segs) >= MAX_SEGMENTS:
            # A very long session: one flat segment again, once in a while.
            flat = [(b + s, b + e) for b, r in segs for s, e in r]
            segs = [(0, flat)]
        segs.append((base, rel))
        return _Offsets(segs)


@dataclass(slots=True)
class _Entry:
    text: str
    ids: list[int]
    offsets: _Offsets


# text -> (ids, [(start, end)] per token), no special tokens added.
Encode = Callable[[str], tuple[list[int], list[tuple[int, int]]]]


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix: a binary search over slice comparisons (each in
    C), so ~log2(n) passes over the text rather than one Python step per character."""
    lo, hi = 0, min(len(a), len(b))
    if a[:hi] == b[:hi]:
        return hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[lo:mid] == b[lo:mid]:
            lo = mid
        else:
            hi = mid
    return lo


class TokenPrefixes:
    """Encodes texts through `encode`, reusing the tokens of a remembered text that shares a
    long prefix with the new one."""

    def __init__(self, encode: Encode) -> None:
        self._encode = encode
        self._lock = threading.Lock()
        self._entries: OrderedDict[int, _Entry] = OrderedDict()  # least recent first
        self._by_probe: dict[str, list[int]] = {}
        self._tokens = 0
        self._next = 0
        self.hits = 0  # encodes that reused a remembered prefix
        self.misses = 0  # reuse refused by the check: encoded whole
        self.reused_tokens = 0

    def ids(self, text: str) -> list[int]:
        if len(text) < MIN_CHARS:
            return self._encode(text)[0]
        best_key, best, common = self._find(text)
        got = self._extend(best, text, common) if best is not None else None
        if got is not None:
            ids, offsets = got
        else:
            ids, rel = self._encode(text)
            offsets = _Offsets([(0, rel)])
        superseded = best_key if best is not None and common == len(best.text) else None
        self._remember(text, ids, offsets, superseded)
        return list(ids)  # the remembered list stays unchanged whatever the caller does

    def _find(self, text: str) -> tuple[int, _Entry | None, int]:
        with self._lock:
            keys = list(self._by_probe.get(text[:PROBE], ()))
            entries = [(k, e) for k in reversed(keys) if (e := self._entries.get(k)) is not None]
        best_key, best, common = -1, None, 0
        for k, e in entries[:MAX_CANDIDATES]:
            n = _common_prefix(e.text, text)
            if n > common:
                best_key, best, common = k, e, n
        return best_key, best, common

    def _extend(self, e: _Entry, text: str, common: int) -> tuple[list[int], _Offsets] | None:
        offsets = e.offsets
        n = len(offsets)
        # The tokens ending by `limit`; the cut goes after the last of them whose successor
        # starts exactly where it ends (no character shared by two tokens, as a split
        # multi-byte character is; no leading space trimmed off the successor's offsets).
        k = offsets.ending_by(common - MARGIN)
        while 0 < k < n and offsets.get(k)[0] != offsets.get(k - 1)[1]:
            k -= 1
        if not 0 < k < n:
            return None
        cut = offsets.get(k - 1)[1]
        tail_ids, tail_offsets = self._encode(text[cut:])
        # The re-encoded tokens that end before the divergence must be the remembered ones.
        checked = 0
        for i, (start, end) in enumerate(tail_offsets):
            if cut + end > common:
                break
            j = k + i
            if j >= n or e.ids[j] != tail_ids[i] or offsets.get(j)[0] != cut + start:
                self.misses += 1
                return None
            checked += 1
        if checked == 0:
            self.misses += 1
            return None
        self.hits += 1
        self.reused_tokens += k
        return e.ids[:k] + tail_ids, offsets.extended(k, cut, tail_offsets)

    def _remember(
        self, text: str, ids: list[int], offsets: _Offsets, superseded: int | None
    ) -> None:
        entry = _Entry(text, ids, offsets)
        with self._lock:
            if superseded is not None and superseded in self._entries:
                self._forget(superseded, self._entries.pop(superseded))
            key = self._next
            self._next += 1
            self._entries[key] = entry
            self._by_probe.setdefault(text[:PROBE], []).append(key)
            self._tokens += len(ids)
            while self._entries and (len(self._entries) > MAX_ENTRIES or self._tokens > MAX_TOKENS):
                self._forget(*self._entries.popitem(last=False))

    def _forget(self, key: int, entry: _Entry) -> None:
        """Drops an entry already taken out of `_entries` from the counts and the probe
        table (under the lock)."""
        self._tokens -= len(entry.ids)
        probe = entry.text[:PROBE]
        keys = self._by_probe.get(probe)
        if keys is not None:
            keys.remove(key)
            if not keys:
                del self._by_probe[probe]
