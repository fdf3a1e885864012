"""How far a request's prefix counts as cached on each endpoint: the rule both backends share.

A backend walks the request's block keys from block 0 and stops at the first block no
endpoint holds at all. It reports the walk as segments: runs of consecutive blocks that carry
the same entries (`(first_block, ((tag, deadline_ms), ...))`). Chained keys make runs long,
so this module does per-segment, not per-block, work.

The rule, per endpoint (the engine must be able to reuse the prefix in EVERY group it has):
- full attention (and MLA or any kind we do not know): a prefix of n blocks is reusable when
  blocks 0..n-1 are all held;
- sliding window of w blocks: when the w blocks before the cut (n-w..n-1, clipped at 0) are held;
- recurrent state (mamba, linear attention): when block n-1, the state at the cut, is held.
The match is the largest n allowed by all of the endpoint's groups that show up in the walk.
Because the walk stops at the first block nobody holds, a model with no full-attention group
can be under-counted past such a hole: that errs towards "not cached", the safe side.
The weighted length adds the best tier weight held at each block of the match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import lru_cache

from extproc.index.base import GPU, GroupKind

Records = Sequence[tuple[str, int]]
Segment = tuple[int, Records]


@lru_cache(maxsize=8192)
def parse_tag(tag: str) -> tuple[str, str, str, GroupKind, int]:
    """`entry_tag` back into (endpoint, medium, group key, kind, window_blocks)."""
    head, _, medium = tag.partition("@")
    addr, _, group = head.partition("#")
    if not group:
        return addr, medium or GPU, "", GroupKind.FULL, 0
    parts = group.split(":")
    try:
        kind = GroupKind(parts[1])
        window = max(1, int(parts[2])) if kind is GroupKind.SLIDING else 0
    except (IndexError, ValueError):
        kind, window = GroupKind.FULL, 0
    return addr, medium or GPU, parts[0], kind, window


class _Endpoint:
    __slots__ = ("groups", "weighted")

    def __init__(self) -> None:
        self.groups: dict[str, tuple[GroupKind, int, list[list[int]]]] = {}
        self.weighted: list[tuple[int, int, float]] = []


def prefix_matches(
    segments: Sequence[Segment],
    walked: int,
    now_ms: int,
    weights: Mapping[str, float],
    default_weight: float,
) -> dict[str, float]:
    """Endpoint -> tier-weighted matched prefix length in blocks (only endpoints with > 0)."""
    eps: dict[str, _Endpoint] = {}
    for i, (start, records) in enumerate(segments):
        end = segments[i + 1][0] if i + 1 < len(segments) else walked
        if end <= start:
            continue
        best: dict[str, float] = {}
        for tag, deadline in records:
            if deadline and deadline < now_ms:
                continue
            addr, medium, gkey, kind, window = parse_tag(tag)
            ep = eps.get(addr)
            if ep is None:
                ep = eps[addr] = _Endpoint()
            group = ep.groups.get(gkey)
            if group is None:
                group = ep.groups[gkey] = (kind, window, [])
            runs = group[2]
            if runs and runs[-1][1] >= start:
                runs[-1][1] = max(runs[-1][1], end)
            else:
                runs.append([start, end])
            w = weights.get(medium, default_weight)
            if w > best.get(addr, -1.0):
                best[addr] = w
        for addr, w in best.items():
            eps[addr].weighted.append((start, end, w))
    out: dict[str, float] = {}
    for addr, ep in eps.items():
        n = _reusable(ep.groups)
        if n <= 0:
            continue
        total = 0.0
        covered = 0
        last_w = 1.0
        for s, e, w in ep.weighted:
            if s >= n:
                break
            span = min(e, n) - s
            total += span * w
            covered += span
            last_w = w
        out[addr] = total + (n - covered) * last_w
    return out


def _reusable(groups: Mapping[str, tuple[GroupKind, int, list[list[int]]]]) -> int:
    allowed: list[tuple[int, int]] | None = None
    for kind, window, runs in groups.values():
        if kind is GroupKind.FULL:
            valid = [(0, runs[0][1] if runs[0][0] == 0 else 0)]
        elif kind is GroupKind.SLIDING:
            valid = [(0, 0)]
            valid += [(1 if s == 0 else s + window, e) for s, e in runs]
        else:
            valid = [(0, 0)]
            valid += [(s + 1, e) for s, e in runs]
        valid = [(lo, hi) for lo, hi in valid if lo <= hi]
        allowed = valid if allowed is None else _intersect(allowed, valid)
    return max((hi for _, hi in allowed), default=0) if allowed else 0


def _intersect(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Intersection of two sorted lists of inclusive integer intervals."""
    out: list[tuple[int, int]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        lo = max(a[i][0], b[j][0])
        hi = min(a[i][1], b[j][1])
        if lo <= hi:
            out.append((lo, hi))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out
