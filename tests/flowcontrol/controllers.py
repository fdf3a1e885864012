"""A `FlowController` built from plugin dicts as the app builds one from a config's `plugins`
(the saturation detector named `concurrency-detector`), for the unit tests that drive one
against a hand-made fleet: bands 10 and 0, per-endpoint admission over the fleet's
endpoints, and whatever else a test sets by keyword."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, Protocol

from extproc.core import EndpointState
from extproc.flowcontrol.config import build_flow_config
from extproc.flowcontrol.controller import FlowController


class Fleet(Protocol):
    """The endpoints as the router's counters (and scrapes) show them now."""

    def endpoints(self) -> Sequence[tuple[str, EndpointState]]: ...
    def states(self) -> Sequence[EndpointState]: ...


def tokens_detector(cap: int, **params: Any) -> dict[str, Any]:
    """`concurrency-detector` counting tokens, `cap` per endpoint (`params`: more of its
    parameters, camelCase as configs spell them)."""
    return {
        "type": "concurrency-detector",
        "parameters": {"concurrencyMode": "tokens", "maxTokenConcurrency": cap, **params},
    }


def controller(fleet: Fleet, plugins: Sequence[dict[str, Any]], **overrides: Any) -> FlowController:
    """A controller over `fleet` from `plugins` (the detector and any flow-control plugin:
    `prefill-gate`, ...); `overrides`: `FlowController` keywords (`endpoints=None` admits by
    the pool's saturation alone, `reserve`, `clock`, ...)."""
    fc = {"saturationDetector": {"pluginRef": "concurrency-detector"}}
    cfg = build_flow_config(fc, None, list(plugins))
    built: dict[str, Any] = {
        "detector": cfg.detector,
        "states": fleet.states,
        "band": cfg.band,
        "ttl_s": cfg.ttl_s,
        "usage_limit": cfg.usage_limit,
        "priorities": (10, 0),
        "endpoints": fleet.endpoints,
        "gate": cfg.gate,
    }
    return FlowController(**(built | overrides))


async def settle() -> None:
    """Lets the controller's woken waiters run."""
    for _ in range(5):
        await asyncio.sleep(0)
