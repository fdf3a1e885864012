"""Candidates and requests for scheduling tests."""

from __future__ import annotations

from extproc.core import Candidate, Endpoint, EndpointState, InferenceRequest, MediaItem, Modality


def req(
    *,
    blocks: int = 0,
    tokens: int = 0,
    media: tuple[str, ...] = (),
    headers: dict[str, str] | None = None,
    adapter: str | None = None,
) -> InferenceRequest:
    return InferenceRequest(
        request_id="r",
        path="/v1/chat/completions",
        model="m",
        block_keys=tuple(range(1, blocks + 1)),
        block_tokens=64,
        prompt_tokens=tokens,
        media=tuple(MediaItem(Modality.IMAGE, h, 256) for h in media),
        headers=headers or {},
        lora_adapter=adapter,
    )


def cand(
    addr: str,
    *,
    prefix: float = 0.0,
    role: str | None = None,
    labels: dict[str, str] | None = None,
    **state: object,
) -> Candidate:
    lab = dict(labels or {})
    if role is not None:
        lab["llm-d.ai/role"] = role
    state.setdefault("age_s", 0.01)
    state.setdefault("is_stale", state["age_s"] is None or state["age_s"] > 0.2)  # type: ignore[operator]
    return Candidate(Endpoint(addr, labels=lab), EndpointState(**state), prefix)  # type: ignore[arg-type]


def addrs(cands) -> list[str]:
    return [c.endpoint.address for c in cands]
