"""What a plugin must be, checked where it enters: its class when the registry is built, its
scores on every request.

A third-party plugin is code we did not write. A class that implements nothing, or a
`Params` that silently accepts misspelt keys, is refused at start-up with a message naming
it; a scorer that returns the wrong number of scores, NaN or values outside [0, 1] (or
raises) loses its say for that request instead of failing the request, and the fault is
counted and logged so it does not go unnoticed.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec

from extproc.errors import ConfigError

log = logging.getLogger("extproc.plugins")

# The methods that make a class a plugin of each kind (see scheduling/framework.py);
# `disaggregate`: a decider a disaggregation handler names.
_ROLES = ("filter", "score", "pick", "handle", "admit", "disaggregate")


def check_plugin_class(cls: type) -> str:
    """The class's type name, or ConfigError saying what is missing."""
    where = f"{cls.__module__}.{cls.__qualname__}"
    name = getattr(cls, "type_name", None)
    if not isinstance(name, str) or not name:
        raise ConfigError(f"plugin class {where} has no type_name")
    params = getattr(cls, "Params", None)
    if not (isinstance(params, type) and issubclass(params, msgspec.Struct)):
        raise ConfigError(f"plugin {name!r} ({where}): Params must be a msgspec.Struct")
    if not params.__struct_config__.forbid_unknown_fields:
        raise ConfigError(
            f"plugin {name!r} ({where}): Params must set forbid_unknown_fields=True "
            "(subclass extproc.plugins.PluginParams), so a misspelt parameter is an error"
        )
    if not any(callable(getattr(cls, m, None)) for m in _ROLES):
        raise ConfigError(
            f"plugin {name!r} ({where}) implements none of filter(), score(), pick(), "
            "handle(), admit(), disaggregate()"
        )
    return name


@dataclass(slots=True)
class PluginFaults:
    """Scores refused per plugin (by configured name); read by the metrics exporter.
    Logging is limited to one line per plugin every `log_every_s` seconds."""

    log_every_s: float = 60.0
    counts: dict[str, int] = field(default_factory=dict)
    _logged_at: dict[str, float] = field(default_factory=dict)

    def record(self, plugin: str, problem: str) -> None:
        self.counts[plugin] = self.counts.get(plugin, 0) + 1
        now = time.monotonic()
        if now - self._logged_at.get(plugin, -math.inf) >= self.log_every_s:
            self._logged_at[plugin] = now
            log.error(
                "scorer ignored for this request",
                extra={"plugin": plugin, "problem": problem, "faults": self.counts[plugin]},
            )


def score_problem(scores: Sequence[float], expected: int) -> str | None:
    """Why these scores cannot be used, or None when they can: one per candidate, each a
    finite number in [0, 1]."""
    if len(scores) != expected:
        return f"returned {len(scores)} scores for {expected} candidates"
    for s in scores:
        # One comparison chain catches NaN too (every comparison with NaN is False).
        if not 0.0 <= s <= 1.0:
            return f"returned {s!r}, outside [0, 1]"
    return None
