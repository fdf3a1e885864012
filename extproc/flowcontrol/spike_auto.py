"""`auto`, the default of `reserve_spike_joint`, `reserve_spike_quantile` and
`reserve_refill_credit`: the joint spike reserve at the 0.95 quantile with the `started`
credit for a picker that keeps a spike term (`reserve_spike_s`), the added term otherwise.

Why: on one picker the joint reserve at the 0.95 quantile with the credit from the decode's
start (bench/RESULTS.md, issue 15, the jointe2e, jcb and joint1p sections) served more
steady goodput than the added 0.9 term with the rate credit in every pair measured, with an
interactive TTFT tail no worse. On two replicas sharing flow state it was left off until the
thirty-second session: its tail had been worse in every pair (the tail2r section), but those
pairs ran with calibration's pairing drifting (fixed since: pairing at a request's end, the
peers' too). Measured again on two replicas, the joint reserve served more steady goodput
in 5 of 5 pairs (0.922 against 0.896 on average; under 0.9 in 1 run against 3;
bench/RESULTS.md, issue 15, thirty-second session), at a tail still a little longer than the
added term's, so one configuration now serves one picker and replicas alike. The three are
one configuration: they were measured together, and each alone is not that result.

A value set explicitly is kept; `auto` is resolved once, at start, and said in one log
line. Without `reserve_spike_s` there is no spike term: `auto` is the old default."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

log = logging.getLogger("extproc.flowcontrol")

Credit = Literal["rate", "predicted", "started"]

# What `auto` means where the joint reserve applies, and where it does not.
JOINT_QUANTILE = 0.95
JOINT_CREDIT: Credit = "started"
ADDED_QUANTILE = 0.9
ADDED_CREDIT: Credit = "rate"


@dataclass(frozen=True, slots=True)
class SpikeSettings:
    """The three settings as the reserve uses them, and why (for the start line)."""

    joint: bool
    quantile: float
    credit: Credit
    reason: str


def resolve(
    joint: bool | Literal["auto"],
    quantile: float | Literal["auto"],
    credit: Credit | Literal["auto"],
    *,
    spike_s: float,
) -> SpikeSettings:
    """Each `auto` of the three as this picker gets it; explicit values unchanged."""
    kept = bool(spike_s)
    reason = "a spike term kept (reserve_spike_s)" if kept else "no spike term (reserve_spike_s 0)"
    j = kept if joint == "auto" else joint
    # The companions follow only where the measured configuration applies: an explicit
    # joint reserve without a spike term keeps the old defaults beside it.
    measured = j and kept
    return SpikeSettings(
        joint=j,
        quantile=(JOINT_QUANTILE if measured else ADDED_QUANTILE)
        if quantile == "auto"
        else quantile,
        credit=(JOINT_CREDIT if measured else ADDED_CREDIT) if credit == "auto" else credit,
        reason=reason,
    )


def say(resolved: SpikeSettings, joint: object, quantile: object, credit: object) -> None:
    """The start line: what each `auto` became and why (nothing if none was `auto`)."""
    autos = [
        f"{name} {value}"
        for name, given, value in (
            ("reserve_spike_joint", joint, str(resolved.joint).lower()),
            ("reserve_spike_quantile", quantile, resolved.quantile),
            ("reserve_refill_credit", credit, resolved.credit),
        )
        if given == "auto"
    ]
    if autos:
        log.info("flow_control auto: %s (%s)", ", ".join(autos), resolved.reason)
