"""Profile handlers: which profiles run for a request, and how their answers become one
Decision."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, Endpoint, InferenceRequest
from extproc.errors import ConfigError
from extproc.protocol import ENCODERS_HEADER, PREFILLER_HEADER
from extproc.scheduling.framework import Decider, ProfileResult, ProfileRunner


def decision_from(result: ProfileResult, **fields: object) -> Decision:
    """The Decision a profile's result makes on its own; `fields` add to or replace its
    Decision fields (a handler's headers, other endpoints, scores of several profiles)."""
    made: dict[str, object] = {
        "endpoints": tuple(c.endpoint for c in result.chosen),
        "scores": result.scores,
        "reasons": result.reasons,
        "profile": result.profile,
        "terms": result.terms,
    }
    return Decision(**(made | fields))  # type: ignore[arg-type]


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
        return decision_from(run(profiles[0]))


_STAGE_ORDERS = {
    "decodefirst": "decode-first",
    "decode": "decode-first",
    "prefillfirst": "prefill-first",
    "prefill": "prefill-first",
}


class DisaggProfiles(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    decode: str = "decode"
    prefill: str = "prefill"
    encode: str = "encode"


class DisaggDeciders(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    prefill: str = ""
    encode: str = ""


class DisaggProfileHandler:
    """Disaggregated serving (llm-d's handler): decode always; a prefill stage and an encode
    stage when their deciders say so.

    `profiles` names the decode, prefill and encode profiles (defaults `decode`, `prefill`,
    `encode`); `deciders.prefill` / `deciders.encode` name decider plugins
    (`prefix-based-pd-decider`, `always-disagg-pd-decider`,
    `always-disagg-multimodal-decider`). Without a decider that stage never runs (llm-d's
    default). `stageOrder: decode-first` (default) picks decode first and asks the deciders
    about that pick; `prefill-first` always runs prefill first and then picks decode near it.
    The request goes to the decode pick; the prefill pick goes in `x-prefiller-host-port`
    (omitted when it is the decode endpoint itself), up to `maxEncoders` encode picks (an
    extproc parameter, default 1) in `x-encoder-hosts-ports`.

    ```yaml
    - type: disagg-profile-handler
      parameters:
        deciders: {prefill: prefix-based-pd-decider, encode: always-disagg-multimodal-decider}
    - type: prefix-based-pd-decider
      parameters: {nonCachedTokens: 16}
    - type: always-disagg-multimodal-decider
    ```
    """

    type_name: ClassVar[str] = "disagg-profile-handler"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        stage_order: str = "decode-first"
        profiles: DisaggProfiles = DisaggProfiles()
        deciders: DisaggDeciders = DisaggDeciders()
        max_encoders: Annotated[int, msgspec.Meta(ge=1)] = 1

        def __post_init__(self) -> None:
            key = self.stage_order.lower().replace("-", "").replace("_", "")
            if key not in _STAGE_ORDERS:
                raise ValueError(
                    f"invalid stageOrder {self.stage_order!r}: decode-first or prefill-first"
                )

    def __init__(self, params: Params | None = None) -> None:
        self._p = params or self.Params()
        key = self._p.stage_order.lower().replace("-", "").replace("_", "")
        self._prefill_first = _STAGE_ORDERS[key] == "prefill-first"
        self._prefill_decider: Decider | None = None
        self._encode_decider: Decider | None = None

    def bind(self, plugins: Mapping[str, object]) -> None:
        d = self._p.deciders
        self._prefill_decider = _decider(plugins, d.prefill, ("deciders", "prefill"))
        self._encode_decider = _decider(plugins, d.encode, ("deciders", "encode"))

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        names = self._p.profiles
        headers: dict[str, str] = {}
        scores: dict[str, Mapping[str, float]] = {}
        reasons: list[str] = []
        prefill: Endpoint | None = None
        encoders: tuple[Endpoint, ...] = ()
        decode_name = names.decode if names.decode in profiles else profiles[0]

        def take(result: ProfileResult) -> ProfileResult:
            scores.update(result.scores)
            reasons.extend(result.reasons)
            return result

        def encode_stage(decode_pick: Candidate | None) -> None:
            nonlocal encoders
            if names.encode not in profiles or self._encode_decider is None:
                return
            if not self._encode_decider.disaggregate(req, decode_pick):
                return
            peer = decode_pick.endpoint if decode_pick else None
            result = take(run(names.encode, self._p.max_encoders, peer))
            encoders = tuple(c.endpoint for c in result.chosen)
            if encoders:
                headers[ENCODERS_HEADER] = ",".join(e.address for e in encoders)

        if self._prefill_first:
            prefill_pick: Candidate | None = None
            if names.prefill in profiles:
                result = take(run(names.prefill))
                prefill_pick = result.chosen[0] if result.chosen else None
            encode_stage(None)
            decode = take(run(decode_name, None, prefill_pick.endpoint if prefill_pick else None))
            if not decode.chosen:
                return decision_from(decode)
            if prefill_pick and prefill_pick.endpoint != decode.chosen[0].endpoint:
                prefill = prefill_pick.endpoint
                headers[PREFILLER_HEADER] = prefill.address
        else:
            decode = take(run(decode_name))
            if not decode.chosen:
                return decision_from(decode)
            pick = decode.chosen[0]
            encode_stage(pick)
            if names.prefill in profiles and self._prefill_decider is not None:
                if self._prefill_decider.disaggregate(req, pick):
                    result = take(run(names.prefill, None, pick.endpoint))
                    if result.chosen and result.chosen[0].endpoint != pick.endpoint:
                        prefill = result.chosen[0].endpoint
                        headers[PREFILLER_HEADER] = prefill.address
                else:
                    reasons.append(f"prefill skipped: {self._p.deciders.prefill} said no")

        return decision_from(
            decode,
            headers=headers,
            prefill=prefill,
            encoders=encoders,
            scores=scores,
            reasons=tuple(reasons),
        )


def _decider(plugins: Mapping[str, object], name: str, where: tuple[str, ...]) -> Decider | None:
    if not name:
        return None
    plugin = plugins.get(name)
    if plugin is None:
        raise ConfigError(f"no plugin named {name!r}", path=where)
    if not isinstance(plugin, Decider):
        raise ConfigError(f"{name!r} is not a decider", path=where)
    return plugin
