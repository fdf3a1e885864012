"""llm-d's other profile handlers: data-parallel ranks behind one port, the older
prefill/decode handler, and a profile chosen by request header."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Annotated, ClassVar

import msgspec

from extproc.core import Candidate, Decision, Endpoint, InferenceRequest
from extproc.protocol import DATA_PARALLEL_HEADER
from extproc.scheduling.framework import ProfileRunner
from extproc.scheduling.handlers import (
    DisaggDeciders,
    DisaggProfileHandler,
    DisaggProfiles,
    decision_from,
)


class DataParallelProfileHandler:
    """vLLM data parallelism: each rank is an endpoint (`ip:rankPort`), but requests enter
    through the pod's primary port. Runs the single profile, puts the chosen rank's
    `ip:port` in `x-data-parallel-host-port` and sends the request to `ip:primaryPort`
    (0 keeps the rank's own port).

    Load and prefix records follow the destination address (`ip:primaryPort`), not the rank.

    ```yaml
    - type: data-parallel-profile-handler
      parameters: {primaryPort: 8000}
    ```
    """

    type_name: ClassVar[str] = "data-parallel-profile-handler"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        primary_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 8000

    def __init__(self, params: Params | None = None) -> None:
        self._port = (params or self.Params()).primary_port

    def _primary(self, e: Endpoint) -> Endpoint:
        if not self._port:
            return e
        host = e.address.rpartition(":")[0]
        return dataclasses.replace(e, address=f"{host}:{self._port}")

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        result = run(profiles[0])
        if not result.chosen:
            return decision_from(result)
        rank = result.chosen[0].endpoint
        return decision_from(
            result,
            endpoints=tuple(self._primary(c.endpoint) for c in result.chosen),
            headers={DATA_PARALLEL_HEADER: rank.address},
        )


class PdProfileHandler:
    """llm-d's older prefill/decode handler: decode first, then prefill elsewhere when the
    decider named by `deciderPluginName` (default `prefix-based-pd-decider`) says so; the
    prefill pick goes in `x-prefiller-host-port`. Same behaviour as `disagg-profile-handler`
    with only a prefill decider.

    ```yaml
    - type: pd-profile-handler
      parameters: {deciderPluginName: prefix-based-pd-decider}
    ```
    """

    type_name: ClassVar[str] = "pd-profile-handler"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        decode_profile: str = "decode"
        prefill_profile: str = "prefill"
        decider_plugin_name: str = "prefix-based-pd-decider"
        primary_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 0
        prefix_plugin_type: str | None = None
        prefix_plugin_name: str | None = None
        prefix_match_info_producer_name: str | None = None

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self._inner = DisaggProfileHandler(
            DisaggProfileHandler.Params(
                profiles=DisaggProfiles(decode=p.decode_profile, prefill=p.prefill_profile),
                deciders=DisaggDeciders(prefill=p.decider_plugin_name),
            )
        )

    def bind(self, plugins: Mapping[str, object]) -> None:
        self._inner.bind(plugins)

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        return self._inner.handle(req, cands, profiles, run)


class HeaderProfileHandler:
    """Runs the one profile the request names in a header (`headerName`, default
    `EPP-Profile`), or `defaultProfile` (default `decode`) without the header. A name that
    is no profile gets no endpoint (the request is refused with 503). With a single profile,
    that one always runs.

    ```yaml
    - type: header-profile-handler
      parameters: {headerName: EPP-Profile, defaultProfile: decode}
    ```
    """

    type_name: ClassVar[str] = "header-profile-handler"

    class Params(msgspec.Struct, frozen=True, forbid_unknown_fields=True, rename="camel"):
        header_name: str = "EPP-Profile"
        default_profile: str = "decode"

    def __init__(self, params: Params | None = None) -> None:
        p = params or self.Params()
        self._header = p.header_name.strip().lower() or "epp-profile"
        self._default = p.default_profile.strip() or "decode"

    def handle(
        self,
        req: InferenceRequest,
        cands: Sequence[Candidate],
        profiles: Sequence[str],
        run: ProfileRunner,
    ) -> Decision:
        if len(profiles) == 1:
            return decision_from(run(profiles[0]))
        asked = req.headers.get(self._header, "").strip()
        name = asked or self._default
        if name not in profiles:
            why = (
                f"{self._header}: {asked!r} names no profile"
                if asked
                else (f"defaultProfile {self._default!r} is not a profile")
            )
            return Decision(endpoints=(), reasons=(why,))
        return decision_from(run(name))
