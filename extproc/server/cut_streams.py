"""The ext_proc streams a picker holds open past their response headers only so flow control
can cut them (`extproc envoy-config --response-trailers send`, docs/flow-control.md
"Eviction").

Envoy runs a response on untouched when the picker ends its stream with OK, but resets it
when the stream fails (the picker dies, or a drain's grace ends with the stream still open:
ext_proc is fail-closed). So only evictable requests keep a stream past their headers, and
a draining picker ends those streams at once (`release_all`): a rolling restart then cuts
no response; the requests merely stop being eviction candidates.

Exported: how many are held now (`extproc_flow_cuttable_streams`), the responses a picker
that died at this moment would cut and the ones a drain would end. What a drain ended is
its log line's count; a counter of it would be read only in the process's last seconds
(`server.drain_delay_s` and the grace), which a scrape interval mostly misses."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator

from prometheus_client.core import Metric

from extproc.server.families import one

log = logging.getLogger(__name__)


class CutStreams:
    """The open cuttable streams, each by the callback that ends it with OK."""

    __slots__ = ("_held", "draining")

    def __init__(self) -> None:
        self._held: set[Callable[[], None]] = set()
        self.draining = False

    def hold(self, let_go: Callable[[], None]) -> bool:
        """Keep a stream open past its response headers; False while draining (the stream
        ends there instead, as a request that cannot be cut does)."""
        if self.draining:
            return False
        self._held.add(let_go)
        return True

    def drop(self, let_go: Callable[[], None]) -> None:
        self._held.discard(let_go)

    def __len__(self) -> int:
        return len(self._held)

    def release_all(self) -> int:
        """The drain: end every held stream with OK now, and hold no new one."""
        self.draining = True
        held, self._held = self._held, set()
        for let_go in held:
            let_go()
        if held:
            log.info(
                "drain: ended %d cuttable ext_proc streams so their responses run on", len(held)
            )
        return len(held)

    def collect(self) -> Iterator[Metric]:
        """Metric families for the picker's registry."""
        yield one(
            "extproc_flow_cuttable_streams",
            "ext_proc streams held open past their response headers so eviction can cut "
            "them (--response-trailers send): the responses a picker that died now would cut "
            "(Envoy resets them), which a drain ends with OK instead.",
            len(self._held),
        )
