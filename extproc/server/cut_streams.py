"""The ext_proc streams a picker holds open past their response headers only so flow control
can cut them (`extproc envoy-config --response-trailers send`, docs/flow-control.md
"Eviction").

Envoy runs a response on untouched when the picker ends its stream with OK, but resets it
when the stream fails (the picker dies, or a drain's grace ends with the stream still open:
ext_proc is fail-closed). So only evictable requests keep a stream past their headers, and
a draining picker ends those streams at once (`release_all`): a rolling restart then cuts
no response; the requests merely stop being eviction candidates."""

from __future__ import annotations

import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class CutStreams:
    """The open cuttable streams, each by the callback that ends it with OK."""

    __slots__ = ("_held", "draining", "released")

    def __init__(self) -> None:
        self._held: set[Callable[[], None]] = set()
        self.draining = False
        self.released = 0  # streams ended by drains, in total

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
        self.released += len(held)
        if held:
            log.info(
                "drain: ended %d cuttable ext_proc streams so their responses run on", len(held)
            )
        return len(held)
