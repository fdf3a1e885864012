"""The one rule for check-config's "parameter X ignored: why" notes: which llm-d parameters
a config actually set. Scheduling and flow-control types (`table.IGNORED_PARAMS`) and mapped
plumbing types (`mapped.MAPPED[...].ignored`) are noted through it alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def is_set(value: Any) -> bool:
    """Whether a parameter's value asks for anything. Null, false and an empty list or
    mapping turn nothing on (in llm-d either): a user who writes `{}` set nothing, so no
    note. Anything else is set, including 0 and an empty string (k8s-notification-source
    spells the core API group "")."""
    if value is None or value is False:
        return False
    return not (isinstance(value, (list, dict)) and not value)


def ignored_notes(reasons: Mapping[str, str], params: Mapping[str, Any]) -> list[str]:
    """'parameter X ignored: why' for each parameter of `params` (as the YAML spelt it) that
    `reasons` names and the config set, in the config's order."""
    return [
        f"parameter {name} ignored: {reasons[name]}"
        for name, value in params.items()
        if name in reasons and is_set(value)
    ]
