"""Which live signals feed scheduling in this process, said once at startup and kept as a
metric, so a picker that silently routes on less than it was configured for is visible.

A signal missing here is not an error (a deployment may run without metrics scraping), but
it must never be a surprise: the log line names what is off, and
`extproc_scheduling_signal{signal=...}` is 0 for it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger("extproc.signals")

SIGNALS = ("scraped-metrics", "in-flight", "kv-events", "approximate-index")


@dataclass(frozen=True, slots=True)
class Signals:
    """What the router reads. `scraped_metrics`: endpoint state comes from `/metrics`
    scrapes (queue, running, KV usage); else in-flight counts only. `kv_events`: the index is
    fed by the engines' KV events (precise). `approximate_index`: the index learns from
    the picker's own decisions."""

    scraped_metrics: bool
    kv_events: bool
    approximate_index: bool
    inflight: bool = True

    def as_dict(self) -> dict[str, bool]:
        return {
            "scraped-metrics": self.scraped_metrics,
            "in-flight": self.inflight,
            "kv-events": self.kv_events,
            "approximate-index": self.approximate_index,
        }

    def announce(self) -> None:
        """The startup log line (a warning for each missing load or cache signal)."""
        on = [name for name, v in self.as_dict().items() if v]
        log.info("scheduling signals: %s", ", ".join(on), extra={"signals": on})
        if not self.scraped_metrics:
            log.warning(
                "no metrics scraping: scheduling sees in-flight counts only (queue and KV-cache "
                "scorers score 0)"
            )
        if not (self.kv_events or self.approximate_index):
            log.warning("no prefix-cache signal: the index is neither fed nor taught")
