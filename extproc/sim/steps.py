"""One engine step's prefill work: how vLLM 0.32's V1 scheduler (`Scheduler.schedule`,
vllm/v1/core/sched/scheduler.py) spends its per-step token budget, reduced to what the
simulator times.

- The budget is `max_num_batched_tokens`. Running requests are served first: every decoding
  sequence takes one token, then each prefill already under way (in the order they started)
  takes its next chunk, min(what it has left, the budget left). A running prefill is never
  set aside for a waiting request, whatever its priority.
- Then the waiting requests (the policy's order: arrival, or (priority, arrival)) take what
  is left: min(its uncached tokens, the budget left). Without chunked prefill a waiting
  prompt that does not fit in what is left ends the step's admissions (vLLM `break`s).
- `long_prefill_token_threshold` (> 0) caps any one request's chunk per step while more than
  one request is running or waiting, so a long prefill leaves budget for the others.

Pure: the engine keeps the state and does the waiting.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class ChunkPolicy:
    """vLLM's scheduler settings of the same names."""

    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0


@dataclass(frozen=True, slots=True)
class Work(Generic[T]):
    """A prefill not finished: `item` (the engine's), `left` tokens still to compute."""

    item: T
    left: int


def plan_step(
    policy: ChunkPolicy,
    running: Sequence[Work[T]],
    waiting: Sequence[Work[T]],
    decoding: int,
    eligible: int,
) -> list[Work[T]]:
    """This step's chunks, as `Work(item, tokens this step)`: `running` are prefills under
    way (in start order), `waiting` those not started (in the policy's order), `decoding`
    the sequences past their prefill (one token each), `eligible` every request running or
    waiting (the threshold applies only when it is more than one)."""
    budget = policy.max_num_batched_tokens - decoding
    cap = policy.long_prefill_token_threshold if eligible > 1 else 0
    out: list[Work[T]] = []
    for w in running:
        if budget <= 0:
            return out
        n = min(cap if 0 < cap < w.left else w.left, budget)
        out.append(Work(w.item, n))
        budget -= n
    for w in waiting:
        if budget <= 0:
            break
        n = cap if 0 < cap < w.left else w.left
        if n > budget and not policy.enable_chunked_prefill:
            break
        n = min(n, budget)
        out.append(Work(w.item, n))
        budget -= n
    return out
