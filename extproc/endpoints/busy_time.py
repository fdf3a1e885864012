"""How long an engine was busy prefilling, from the per-request sums it exports.

vLLM times each request's prefill from its first scheduled step to its first token
(`request_prefill_time_seconds`), and prefills that share engine steps each count every
shared step: k requests prefilled in one step add k step times to the sum while the engine
worked one. Their sum over an interval is the engine's busy time only when no two overlapped.
No exported metric times the engine's steps (vLLM 0.32 logs `SchedulerIterationDetails
.elapsed_ms` but exports no per-step time, and `iteration_tokens_total` is observed per
output batch, not per step), so busy time is rebuilt here from what each scrape adds:

- the interval's requests (n of them, prefill seconds s, decode seconds d) finished inside
  the wall interval w between two scrapes; their prefills ended about d/n before, and, each
  ending somewhere in that interval and lasting s/n on average, together covered at most
  w + s/n seconds, and at most s (no overlap): the interval's segment is the last
  min(s, w + s/n) seconds before (scrape time - d/n);
- the busy time of a window of intervals is the length of the union of their segments:
  requests overlapping across scrapes (a queue worked through under chunked prefill) cover
  the same seconds once.

A lone prefill's segment is exactly its prefill time (n = 1), so an idle engine reads as
before; a saturated engine's segments tile the wall time it was busy. The estimate is never
more than the sum of prefill times (so never slower than the per-request ratio); it errs
fast only where requests of very different lengths finish in one scrape interval without
having overlapped (the mean stands for the longest), slow where the interval is long
against the prefills (a missed scrape): at the picker's 50 ms scrapes, rarely either.
"""

from __future__ import annotations

from collections.abc import Iterable


def segment(
    now: float, interval_s: float, seconds: float, count: float, decode_s: float, decode_n: float
) -> tuple[float, float] | None:
    """The busy segment (start, end) of `count` prefills of `seconds` in all, finished in the
    `interval_s` before `now`, whose decodes took `decode_s` over `decode_n` requests
    (0: not exported, no shift). None: nothing prefilled."""
    if seconds <= 0 or count <= 0:
        return None
    shift = decode_s / decode_n if decode_n > 0 and decode_s > 0 else 0.0
    length = min(seconds, max(0.0, interval_s) + seconds / count)
    end = now - shift
    return end - length, end


def covered(segments: Iterable[tuple[float, float]]) -> float:
    """Seconds covered by the union of `segments`."""
    total = 0.0
    cur_start = cur_end = None
    for start, end in sorted(segments):
        if cur_end is None or start > cur_end:
            if cur_end is not None and cur_start is not None:
                total += cur_end - cur_start
            cur_start, cur_end = start, end
        elif end > cur_end:
            cur_end = end
    if cur_end is not None and cur_start is not None:
        total += cur_end - cur_start
    return total
