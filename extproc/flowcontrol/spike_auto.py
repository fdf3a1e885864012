"""`auto`, the default of `reserve_spike_joint`, `reserve_spike_quantile` and
`reserve_refill_credit`: the joint spike reserve with the `started` credit for a picker
that keeps a spike term (`reserve_spike_s`) and has no peers, the added term otherwise.

Why alone only: on one picker the joint reserve at the 0.95 quantile with the credit from
the decode's start (bench/RESULTS.md, issue 15, the jointe2e, jcb and joint1p sections)
served more steady goodput than the added 0.9 term with the rate credit in every pair
measured, with an interactive TTFT tail no worse; on two replicas sharing flow state its
tail was worse in every pair (each replica lets lower work into room the other's
interactive requests then need: the tail2r section), so there it stays off. The three are
one configuration: they were measured together, and each alone is not that result.

A value set explicitly is kept; `auto` is resolved once, at start, from whether the
picker exchanges flow state (`flow_control.shared` with a Redis index), and said in one
log line. Without `reserve_spike_s` there is no spike term: `auto` is the old default."""

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
    shared_state: bool,
) -> SpikeSettings:
    """Each `auto` of the three as this picker gets it; explicit values unchanged.
    `shared_state`: this picker exchanges flow state with peers (replicas)."""
    if not spike_s:
        reason = "no spike term (reserve_spike_s 0)"
        alone = False
    elif shared_state:
        reason = "flow state shared with peers"
        alone = False
    else:
        reason = "one picker: no shared flow state"
        alone = True
    j = alone if joint == "auto" else joint
    # The companions follow only where the measured configuration applies: an explicit
    # joint reserve on replicas keeps the old defaults beside it.
    measured = j and alone
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
