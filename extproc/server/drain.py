"""The SIGTERM drain of the ext_proc server: how long open streams may finish, and what is
cut when they do not.

Envoy resets a response whose ext_proc stream is still open when the picker exits
(fail-closed, and with `failure_mode_allow` too once a FULL_DUPLEX_STREAMED body has
started). Under our own `envoy-config` a stream ends at its response headers, so open streams
end soon and `server.grace_s` (10 s) bounds the wait. Under every real gateway's settings
(Istio, Envoy AI Gateway, llm-d: response bodies FULL_DUPLEX_STREAMED) the stream lasts to
the response's end, a long generation's minutes, and the picker cannot end it early without
harm: measured on Envoy 1.40 (bench/probe_gwdrain.py, docs/reliability.md "Rolling
restarts"), ending it with OK mid-body runs the rest of the response on untouched, but every
chunk Envoy had already sent to the picker and not got back is dropped silently (HTTP 200, a
gap in the output), and the picker cannot know whether one is in flight. So while such a
stream is open the drain waits up to `server.response_grace_s` instead; streams still open
at the bound are cut, counted by phase (`DrainStats.cut`) and logged in one line.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal, Protocol

log = logging.getLogger(__name__)

# Where an open ext_proc stream is: its response body passes through the picker and has
# started, will pass (request phase, or waiting for the response headers), or does not.
StreamPhase = Literal["response_body", "before_response_body", "no_response_body"]
PHASES: tuple[StreamPhase, ...] = ("response_body", "before_response_body", "no_response_body")


class Stoppable(Protocol):
    async def stop(self, grace: float | None) -> None: ...


@dataclass(slots=True)
class DrainStats:
    """Ext_proc streams still open when a drain's bound ended, by phase (`cut`): their
    responses are reset by the proxy. `extended`: drains that waited past `grace_s` because a
    response body was streaming through the picker."""

    cut: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PHASES, 0))
    extended: int = 0


@dataclass(frozen=True, slots=True)
class DrainBounds:
    """`grace_s`: the wait for open streams; `response_grace_s`: the wait instead while a
    stream carries a response body through the picker (the longer one applies)."""

    grace_s: float
    response_grace_s: float

    def bound_s(self, phases: Iterable[StreamPhase]) -> float:
        if any(p != "no_response_body" for p in phases):
            return max(self.grace_s, self.response_grace_s)
        return self.grace_s


async def drain(
    server: Stoppable,
    phases: Callable[[], list[StreamPhase]],
    bounds: DrainBounds,
    stats: DrainStats,
) -> None:
    """Stop accepting streams, let the open ones finish within the bound their phases call
    for (`DrainBounds`), then abort the rest, counted and logged. `phases()`: the open
    ext_proc streams' phases now (other services' streams on `server`, such as access logs,
    are ended by the caller)."""
    now = phases()
    bound = bounds.bound_s(now)
    if bound > bounds.grace_s:
        stats.extended += 1
        log.info(
            "drain: waiting up to %g s for %d open ext_proc streams (%d with a response body "
            "passing through the picker: cutting those early would reset or corrupt the "
            "response)",
            bound,
            len(now),
            sum(p != "no_response_body" for p in now),
            extra={"bound_s": bound, "open_streams": len(now)},
        )
    # grpc aborts what is left at its grace; ours ends first so the count is taken at the
    # moment of the abort (a later, smaller grace stops the server sooner).
    stopping = asyncio.ensure_future(server.stop(bound + 5.0))
    done, _ = await asyncio.wait((stopping,), timeout=bound)
    if not done:
        left = Counter(phases())
        for phase, n in left.items():
            stats.cut[phase] += n
        if left:
            log.warning(
                "drain: %d ext_proc streams still open after %g s were cut (%d mid-response "
                "body): the proxy resets their responses; raise server.response_grace_s "
                "(and terminationGracePeriodSeconds) to let them finish",
                sum(left.values()),
                bound,
                left["response_body"],
                extra={"cut": dict(left), "bound_s": bound},
            )
        await server.stop(0)
    await stopping
