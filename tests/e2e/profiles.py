"""The default scheduling profile as a picker config's `scheduling` section, with some of its
plugins' parameters set: e2e tests of one plugin's option run it inside the profile users
get, and follow that profile when it changes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import msgspec
import yaml

from extproc.scheduling.config import default_config


def _no_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _no_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_no_nulls(v) for v in value]
    return value


def default_profile_with(parameters: Mapping[str, Mapping[str, Any]]) -> str:
    """YAML for `scheduling:`: the default config, the plugins named (by type) in
    `parameters` given those parameters."""
    cfg = default_config()
    unknown = set(parameters) - {p.type for p in cfg.plugins}
    assert not unknown, f"not in the default profile: {sorted(unknown)}"
    plugins = [
        msgspec.structs.replace(p, parameters=dict(parameters[p.type]))
        if p.type in parameters
        else p
        for p in cfg.plugins
    ]
    scheduling = _no_nulls(msgspec.to_builtins(msgspec.structs.replace(cfg, plugins=plugins)))
    return yaml.safe_dump({"scheduling": scheduling}, sort_keys=False)


def profile_of(
    weights: Mapping[str, float], parameters: Mapping[str, Mapping[str, Any]] | None = None
) -> str:
    """YAML for `scheduling:`: one profile, `default`, of the scorers in `weights` (by type,
    at those weights, with `parameters` by type where given) and `max-score-picker`: for
    tests of one plugin on its own, outside the profile users get."""
    parameters = parameters or {}
    unknown = set(parameters) - set(weights)
    assert not unknown, f"parameters for plugins not in the profile: {sorted(unknown)}"
    plugins: list[dict[str, Any]] = [
        {"type": t, "parameters": dict(parameters[t])} if t in parameters else {"type": t}
        for t in weights
    ]
    refs: list[dict[str, Any]] = [{"pluginRef": t, "weight": w} for t, w in weights.items()]
    scheduling = {
        "plugins": [*plugins, {"type": "max-score-picker"}],
        "schedulingProfiles": [
            {"name": "default", "plugins": [*refs, {"pluginRef": "max-score-picker"}]}
        ],
    }
    return yaml.safe_dump({"scheduling": scheduling}, sort_keys=False)
