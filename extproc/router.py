"""One routing decision, independent of the transport: parse the request, gather candidates
with their live state, run the scheduler, account the placement.

`server/` feeds it headers and the body and turns its `Routed` into ext_proc messages;
`extproc explain` and the tests call it directly.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass

from extproc.core import Candidate, Decision, EndpointState, InferenceRequest
from extproc.endpoints import EndpointPool, InFlight
from extproc.endpoints.inflight import Placement
from extproc.errors import NoEndpoints
from extproc.scheduling import Scheduler

Parser = Callable[[str, Mapping[str, str], bytes], InferenceRequest]


@dataclass(frozen=True, slots=True)
class Routed:
    """A decision plus the in-flight placement to release when the request ends."""

    request: InferenceRequest
    decision: Decision
    placement: Placement


class Router:
    def __init__(
        self,
        *,
        pool: EndpointPool,
        scheduler: Scheduler,
        parser: Parser,
        inflight: InFlight | None = None,
    ) -> None:
        self.pool = pool
        self.scheduler = scheduler
        self.inflight = inflight or InFlight()
        self._parse = parser

    async def route(
        self,
        path: str,
        headers: Mapping[str, str],
        body: bytes | None,
        *,
        subset: Collection[str] | None = None,
        explain: bool = False,
    ) -> Routed:
        """Decide where a request goes; `body=None` means the body is not available.
        Raises `BadRequest` for an unparseable request and
        `NoEndpoints` when nothing is eligible (an empty subset hint included).

        Async because the prefix-index lookup is; scheduling itself never awaits."""
        if body is None:
            # The proxy never shows us this body (body mode NONE/STREAMED): route on headers.
            request = InferenceRequest(
                request_id=headers.get("x-request-id", ""), path=path, headers=headers
            )
        else:
            request = self._parse(path, headers, body)
        endpoints = self.pool.snapshot()
        if subset is not None:
            endpoints = tuple(e for e in endpoints if e.address in subset)
        if not endpoints:
            raise NoEndpoints("no model-server endpoint is eligible for this request")
        inflight = self.inflight
        cands = [
            Candidate(
                endpoint=e,
                state=EndpointState(
                    inflight_requests=inflight.requests(e.address),
                    inflight_tokens=inflight.tokens(e.address),
                ),
            )
            for e in endpoints
        ]
        decision = self.scheduler.schedule(request, cands, explain=explain)
        if not decision.endpoints:
            raise NoEndpoints("no model-server endpoint is eligible for this request")
        placement = inflight.acquire(decision.primary.address, request.prompt_tokens)
        return Routed(request, decision, placement)

    def finish(self, routed: Routed) -> None:
        """The request's stream ended (response done, client gone, or error)."""
        self.inflight.release(routed.placement)
