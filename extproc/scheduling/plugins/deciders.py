"""Disaggregation deciders: whether a request gets a separate prefill or encode stage.
Named by `disagg-profile-handler`'s `deciders` (and `pd-profile-handler`'s
`deciderPluginName`); llm-d's types, parameters and defaults."""

from __future__ import annotations

from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, InferenceRequest

_NonNegative = Annotated[int, msgspec.Meta(ge=0)]


class PrefixBasedPDDecider:
    """Prefill runs elsewhere when the prompt tokens the decode pick does not already hold
    reach `nonCachedTokens`. Off when `nonCachedTokens` is 0 (llm-d's default). With
    `promptTokens` > 0, prompts shorter than that never disaggregate.

    ```yaml
    - type: prefix-based-pd-decider
      parameters: {nonCachedTokens: 16}
    ```
    """

    type_name: ClassVar[str] = "prefix-based-pd-decider"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        non_cached_tokens: _NonNegative = 0
        prompt_tokens: _NonNegative = 0

    def __init__(self, params: Params | None = None) -> None:
        self._p = params or self.Params()

    def disaggregate(self, req: InferenceRequest, decode: Candidate | None) -> bool:
        p = self._p
        if p.non_cached_tokens == 0 or decode is None:
            return False
        tokens = req.prompt_tokens
        if p.prompt_tokens and tokens < p.prompt_tokens:
            return False
        if tokens < p.non_cached_tokens:
            return False
        cached = int(decode.prefix_blocks * req.block_tokens)
        return tokens - cached >= p.non_cached_tokens


class AlwaysDisaggPDDecider:
    """Every request gets a separate prefill stage.

    ```yaml
    - type: always-disagg-pd-decider
    ```
    """

    type_name: ClassVar[str] = "always-disagg-pd-decider"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        pass

    def __init__(self, params: Params | None = None) -> None:
        pass

    def disaggregate(self, req: InferenceRequest, decode: Candidate | None) -> bool:
        return True


class AlwaysDisaggMultimodalDecider:
    """Requests that carry media (image, audio, video) get a separate encode stage; text-only
    requests never do.

    ```yaml
    - type: always-disagg-multimodal-decider
    ```
    """

    type_name: ClassVar[str] = "always-disagg-multimodal-decider"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
        pass

    def __init__(self, params: Params | None = None) -> None:
        pass

    def disaggregate(self, req: InferenceRequest, decode: Candidate | None) -> bool:
        return req.has_media
