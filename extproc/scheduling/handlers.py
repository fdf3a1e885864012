"""Profile handlers: which profiles run for a request, and how their answers become one
Decision."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, Endpoint, InferenceRequest
from extproc.scheduling.framework import ProfileResult, ProfileRunner

PREFILLER_HEADER = "x-prefiller-host-port"
ENCODERS_HEADER = "x-encoder-hosts-ports"


def _decision(result: ProfileResult, **extra: object) -> Decision:
    return Decision(
        endpoints=tuple(c.endpoint for c in result.chosen),
        scores=result.scores,
        reasons=result.reasons,
        profile=result.profile,
        **extra,  # type: ignore[arg-type]
    )


class SingleProfileHandler:
    """Runs the first (usually the only) profile. The default.

    ```yaml
    - type: single-profile-handler
    ```
    """

    type_name: ClassVar[str] = "single-profile-handler"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        pass

    def __init__(self, params: Params | None = None) -> None:
        pass

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        return _decision(run(profiles[0]))


class DisaggProfileHandler:
    """Disaggregated serving: decode always; prefill elsewhere when the uncached prompt is
    long; an encode tier when the request carries media.

    Profiles by name: `decode` (required), `prefill` and `encode` (optional). The request is
    sent to the decode pick. Prefill runs only when the prompt tokens the decode pick does not
    already hold exceed `threshold` tokens; its pick goes in `x-prefiller-host-port`. Encode
    runs only for requests with media; up to `maxEncoders` picks go in `x-encoder-hosts-ports`.
    Text-only requests never get an encoder header.

    ```yaml
    - type: disagg-profile-handler
      parameters: {threshold: 512, maxEncoders: 1}
    ```
    """

    type_name: ClassVar[str] = "disagg-profile-handler"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        threshold: Annotated[int, msgspec.Meta(ge=0)] = 512
        max_encoders: Annotated[int, msgspec.Meta(ge=1)] = 1
        decode_profile: str = "decode"
        prefill_profile: str = "prefill"
        encode_profile: str = "encode"

    def __init__(self, params: Params | None = None) -> None:
        self._p = params or self.Params()

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        p = self._p
        decode = run(p.decode_profile if p.decode_profile in profiles else profiles[0])
        if not decode.chosen:
            return _decision(decode)
        headers: dict[str, str] = {}
        scores = dict(decode.scores)
        reasons = list(decode.reasons)
        prefill: Endpoint | None = None
        encoders: tuple[Endpoint, ...] = ()

        if p.prefill_profile in profiles:
            cached_tokens = int(decode.chosen[0].prefix_blocks * req.block_tokens)
            uncached = max(0, req.prompt_tokens - cached_tokens)
            if uncached > p.threshold:
                result = run(p.prefill_profile)
                scores.update(result.scores)
                reasons.extend(result.reasons)
                if result.chosen and result.chosen[0].endpoint != decode.chosen[0].endpoint:
                    prefill = result.chosen[0].endpoint
                    headers[PREFILLER_HEADER] = prefill.address
            else:
                reasons.append(f"prefill skipped: {uncached} uncached tokens <= {p.threshold}")

        if req.has_media and p.encode_profile in profiles:
            result = run(p.encode_profile, p.max_encoders)
            scores.update(result.scores)
            reasons.extend(result.reasons)
            encoders = tuple(c.endpoint for c in result.chosen)
            if encoders:
                headers[ENCODERS_HEADER] = ",".join(e.address for e in encoders)

        return Decision(
            endpoints=tuple(c.endpoint for c in decode.chosen),
            headers=headers,
            prefill=prefill,
            encoders=encoders,
            scores=scores,
            reasons=tuple(reasons),
            profile=decode.profile,
        )
