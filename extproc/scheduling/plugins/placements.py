"""Where each prefix was last placed, remembered after every cache has evicted it.

The index credits an endpoint only with what its cache still holds (the capacity model in
approximate mode, KV events in precise mode). Once a prefix group's blocks are evicted
everywhere, a request of that group looks new: every endpoint holds the same shared header,
predicted TTFT is equal up to the queues, and `no-hit-lru-scorer` deals it to the endpoint
that least recently took a new prefix. A group then ends up written to several servers
over a run, each copy displacing another group (issue 14, tenants workload: 31-50 requests
a run are "known tenant, evicted everywhere", the biggest tenant written to 4-5 of 6
servers).

`PlacementMemory` keeps, for sampled block positions of each placed request, the endpoint
that last received that prefix: the keys are chained, so a remembered key at position p
stands for the request's whole first p + 1 blocks. It holds at most `max_keys` keys, least
recently placed forgotten first; it is not the index (no capacity model cuts it), only the
last placement.

`PlacementMemoryScorer` uses it for requests the index sees as new (no endpoint holds more
of them than most endpoints do, as `no-hit-lru-scorer` defines it) while the memory
remembers a longer prefix than any endpoint is credited with: 1.0 on the endpoint that
last took that prefix, 0 elsewhere. The group goes back where it lived instead of onto
another server; the other scorers still weigh the load there (the weight of this scorer
is a tie-break against predicted TTFT, not an override), and the filters still apply.
`no-hit-lru-scorer` in the same profile leaves such requests alone (they are not new).

Opt-in, not in the default profile: on the tenants workload the LRU caches had dropped
everything of such a tenant by the time the index forgot it (a replay of traced runs:
nothing beyond the header left on any server in 122 of 122 such misses), so going back hits
nothing, and it evicts the home's blocks instead of those of the server that took a new
prefix least recently; interleaved bench runs measured 2-6 points less hit ratio with it
(bench/RESULTS.md, issue 14, seventh session). It would pay where caches keep a group's
blocks longer than the index credits them (an index evicting early).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest
from extproc.scheduling.plugins.prefix import is_new

# Sampled positions per octave of request length: a remembered prefix is known to within
# a factor 2 ** (1 / 4) of its length (~19%), at ~4 keys per doubling, so a 2,000-block
# request costs ~44 dict writes, not 2,000.
_PER_OCTAVE = 4


def sample_positions(n: int) -> list[int]:
    """Block positions remembered for a request of `n` blocks: a geometric grid (every
    request gets the same positions below its length, so two requests sharing a prefix share
    the keys at its positions) and the last block."""
    out: list[int] = []
    j = 0
    while True:
        p = round(2.0 ** (j / _PER_OCTAVE)) - 1
        if p >= n:
            break
        if not out or p > out[-1]:
            out.append(p)
        j += 1
    if n and (not out or out[-1] != n - 1):
        out.append(n - 1)
    return out


class PlacementMemory:
    """Block key -> the endpoint that last received a request containing it."""

    def __init__(self, max_keys: int) -> None:
        self._max = max_keys
        self._where: OrderedDict[int, str] = OrderedDict()  # least recently placed first

    def __len__(self) -> int:
        return len(self._where)

    def remember(self, block_keys: Sequence[int], endpoint: str) -> None:
        where = self._where
        for p in sample_positions(len(block_keys)):
            key = block_keys[p]
            where[key] = endpoint
            where.move_to_end(key)
        while len(where) > self._max:
            where.popitem(last=False)

    def recall(self, block_keys: Sequence[int]) -> tuple[str, int] | None:
        """(endpoint, blocks): the longest remembered prefix of the request and where it was
        last placed, or None."""
        where = self._where
        for p in reversed(sample_positions(len(block_keys))):
            endpoint = where.get(block_keys[p])
            if endpoint is not None:
                return endpoint, p + 1
        return None

    def forget_endpoint(self, endpoint: str) -> None:
        """`endpoint` restarted or left: nothing of it is worth going back to."""
        self._where = OrderedDict((k, e) for k, e in self._where.items() if e != endpoint)


class PlacementMemoryScorer:
    """For a request the index sees as new whose longer prefix was placed before: 1.0 on the
    endpoint that last received that prefix, 0 elsewhere; 1.0 everywhere otherwise.

    ```yaml
    - type: placement-memory-scorer
      parameters: {maxKeys: 200000}
    ```
    """

    type_name: ClassVar[str] = "placement-memory-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        # ~100 bytes a key: 200k keys ~ 20 MB, ~4,500 placements of 2,000-block requests,
        # far more of short ones.
        max_keys: Annotated[int, msgspec.Meta(gt=0)] = 200_000

    def __init__(self, params: Params | None = None) -> None:
        self.memory = PlacementMemory((params or self.Params()).max_keys)
        # The answer given while scoring, reused for the same request by no-hit-lru.
        self._last: tuple[InferenceRequest, str | None] | None = None

    def home(self, req: InferenceRequest, cands: Sequence[Candidate]) -> str | None:
        """The endpoint to send `req` back to: it last received a longer prefix of `req`
        than the index credits anyone with, while the index sees `req` as new."""
        last = self._last
        if last is not None and last[0] is req:
            return last[1]
        home = None
        if req.block_keys and cands and is_new(cands):
            found = self.memory.recall(req.block_keys)
            credited = max(c.prefix_blocks for c in cands)
            if found is not None and found[1] > credited:
                home = found[0]
        self._last = (req, home)
        return home

    def sends_back(self, req: InferenceRequest, cands: Sequence[Candidate]) -> bool:
        """Whether `req` has a home among `cands` (then it is not a new prefix to spread)."""
        home = self.home(req, cands)
        return home is not None and any(c.endpoint.address == home for c in cands)

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        if not self.sends_back(req, cands):
            return [1.0] * len(cands)
        home = self.home(req, cands)
        return [1.0 if c.endpoint.address == home else 0.0 for c in cands]

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        # Answered (and kept in `_last`) before the placement is remembered: an observer
        # after this one (no-hit-lru) asks about the request as it was before it was placed.
        self.home(req, cands)
        if decision.endpoints and req.block_keys:
            self.memory.remember(req.block_keys, decision.primary.address)

    def endpoint_reset(self, address: str) -> None:
        self.memory.forget_endpoint(address)
