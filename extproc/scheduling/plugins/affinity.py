"""Affinity scorers beyond the KV cache: sessions and the encoder (media embedding) cache."""

from __future__ import annotations

import base64
import binascii
from collections import OrderedDict
from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, InferenceRequest
from extproc.protocol import SESSION_TOKEN_HEADER


def session_token(address: str) -> str:
    return base64.urlsafe_b64encode(address.encode()).decode().rstrip("=")


def session_address(token: str) -> str | None:
    try:
        return base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
    except (binascii.Error, ValueError):
        return None


class EncodedEndpointHeaderConfig(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    header: str = SESSION_TOKEN_HEADER


class SessionParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
    """llm-d's session-affinity parameters. Only the `encoded_endpoint_header` strategy is
    implemented; `profileName` is accepted (the token always names the primary pick)."""

    strategy: str = "encoded_endpoint_header"
    encoded_endpoint_header_config: EncodedEndpointHeaderConfig = EncodedEndpointHeaderConfig()
    session_id_config: dict[str, object] | None = None
    profile_name: str | None = None

    def __post_init__(self) -> None:
        if self.strategy == "session_id":
            raise ValueError("strategy session_id is not implemented (encoded_endpoint_header is)")
        if self.strategy != "encoded_endpoint_header":
            raise ValueError(
                f"strategy must be encoded_endpoint_header or session_id, got {self.strategy!r}"
            )

    @property
    def header(self) -> str:
        return (self.encoded_endpoint_header_config.header or SESSION_TOKEN_HEADER).lower()


class _SessionToken:
    """The session token round trip both session plugins share."""

    Params = SessionParams

    def __init__(self, params: SessionParams | None = None) -> None:
        self.header = (params or SessionParams()).header

    def _target(self, req: InferenceRequest) -> str | None:
        token = req.headers.get(self.header)
        return session_address(token) if token else None

    def response_headers(self, decision: Decision) -> dict[str, str]:
        return {self.header: session_token(decision.primary.address)}


class SessionAffinityScorer(_SessionToken):
    """Keeps a session on the endpoint that served it: 1.0 for that endpoint, 0.0 elsewhere.

    The picker returns a session token (the serving endpoint, encoded) in the
    `x-session-token` response header; a client that sends it back is scored toward the same
    endpoint. Stateless, so it holds across picker replicas. No token: no preference.

    ```yaml
    - type: session-affinity-scorer
      parameters: {encodedEndpointHeaderConfig: {header: x-session-token}}
    ```
    """

    type_name: ClassVar[str] = "session-affinity-scorer"

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        target = self._target(req)
        if target is None:
            return [0.0] * len(cands)
        return [1.0 if c.endpoint.address == target else 0.0 for c in cands]


class SessionAffinityFilter(_SessionToken):
    """Like `session-affinity-scorer`, but hard: when the session token names a candidate,
    only that candidate is kept; otherwise (no token, or its endpoint is gone) all are.

    ```yaml
    - type: session-affinity-filter
    ```
    """

    type_name: ClassVar[str] = "session-affinity-filter"

    def filter(self, req: InferenceRequest, cands: Sequence[Candidate]) -> Sequence[Candidate]:
        target = self._target(req)
        if target is None:
            return cands
        kept = [c for c in cands if c.endpoint.address == target]
        return kept or cands


class HeaderLabelAffinityScorer:
    """1.0 for endpoints whose label `labelKey` equals the request header `headerName`,
    0.0 for the others and for all when the header is absent.

    ```yaml
    - type: header-label-affinity-scorer
      parameters: {headerName: x-tenant, labelKey: tenant}
    ```
    """

    type_name: ClassVar[str] = "header-label-affinity-scorer"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        header_name: str
        label_key: str

        def __post_init__(self) -> None:
            if not self.header_name or not self.label_key:
                raise ValueError("headerName and labelKey are required")

    def __init__(self, params: Params) -> None:
        self._header = params.header_name.lower()
        self._label = params.label_key

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        wanted = req.headers.get(self._header, "")
        if not wanted:
            return [0.0] * len(cands)
        return [1.0 if c.endpoint.labels.get(self._label) == wanted else 0.0 for c in cands]


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

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        capacity: Annotated[int, msgspec.Meta(gt=0)] = 2048
        producer_name: str | None = None

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
