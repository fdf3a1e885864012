"""Affinity scorers beyond the KV cache: sessions and the encoder (media embedding) cache."""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest

SESSION_TOKEN_HEADER = "x-session-token"


def session_token(address: str) -> str:
    return base64.urlsafe_b64encode(address.encode()).decode().rstrip("=")


def session_address(token: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, ValueError):
        return None


class SessionAffinityScorer:
    """Keeps a session on the endpoint that served it: 1.0 for that endpoint, 0.0 elsewhere.

    The picker returns a session token (the serving endpoint, encoded) in the
    `x-session-token` response header; a client that sends it back is scored toward the same
    endpoint. Stateless, so it holds across picker replicas. No token: no preference.

    ```yaml
    - type: session-affinity-scorer
      parameters: {header: x-session-token}
    ```
    """

    type_name: ClassVar[str] = "session-affinity-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        header: str = SESSION_TOKEN_HEADER

    def __init__(self, params: Params | None = None) -> None:
        self.header = (params or self.Params()).header.lower()

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        token = req.headers.get(self.header)
        target = session_address(token) if token else None
        if target is None:
            return [0.0] * len(cands)
        return [1.0 if c.endpoint.address == target else 0.0 for c in cands]

    def response_headers(self, decision: Decision) -> dict[str, str]:
        return {self.header: session_token(decision.primary.address)}


class EncoderCacheScorer:
    """For requests with media: the fraction of the request's media items (by content hash)
    each endpoint recently received, i.e. likely still has encoded in its encoder cache.
    An LRU of `capacity` items per endpoint; requests without media score 1.0 everywhere.

    ```yaml
    - type: mm-embeddings-cache-scorer
      parameters: {capacity: 2048}
    ```
    """

    type_name: ClassVar[str] = "mm-embeddings-cache-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        capacity: Annotated[int, msgspec.Meta(gt=0)] = 2048

    def __init__(self, params: Params | None = None) -> None:
        self._capacity = (params or self.Params()).capacity
        self._seen: dict[str, OrderedDict[str, None]] = {}

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        if not req.media:
            return [1.0] * len(cands)
        hashes = [m.content_hash for m in req.media]
        out = []
        for c in cands:
            seen = self._seen.get(c.endpoint.address)
            out.append(sum(h in seen for h in hashes) / len(hashes) if seen else 0.0)
        return out

    def observe(
        self, req: InferenceRequest, cands: Sequence[Candidate], decision: Decision
    ) -> None:
        if not req.media or not decision.endpoints:
            return
        # Where the media gets encoded: the encode tier when there is one, else the pick.
        for ep in decision.encoders or (decision.primary,):
            lru = self._seen.setdefault(ep.address, OrderedDict())
            for m in req.media:
                lru.pop(m.content_hash, None)
                lru[m.content_hash] = None
            while len(lru) > self._capacity:
                lru.popitem(last=False)
