"""The plugin author's whole API: import from here, nothing else.

A plugin is a class with a kebab-case `type_name`, a `Params` struct (decoded strictly from
the `parameters` of its YAML entry) and one method of a protocol below. It is pure: no I/O,
no awaits; what it needs arrives in the `Candidate`s. Ship it in a package that declares an
entry point in the `extproc.plugins` group, then name its type in the picker config:

```python
from extproc.plugins import Candidate, InferenceRequest, PluginParams

class PreferLabel:
    '''Prefers endpoints carrying `label` (1.0) over the rest (0.0).'''
    type_name = "prefer-label-scorer"

    class Params(PluginParams):
        label: str = "tier=fast"

    def __init__(self, params: Params) -> None:
        self._key, _, self._value = params.label.partition("=")

    def score(self, req: InferenceRequest, cands: Sequence[Candidate]) -> list[float]:
        return [float(c.endpoint.labels.get(self._key) == self._value) for c in cands]
```

`extproc.testing` has the builders to unit-test it (`make_request`, `make_candidate`,
`plugin_registry`). Everything listed in `__all__` is a stable API: names are only removed
after a deprecation release. Everything else in the package is internal.
"""

from __future__ import annotations

import msgspec

from extproc.core import (
    Api,
    Candidate,
    Decision,
    Endpoint,
    EndpointState,
    InferenceRequest,
    MediaItem,
    Message,
    Modality,
    Part,
    Prompt,
)
from extproc.errors import ConfigError
from extproc.scheduling.framework import (
    Filter,
    Observer,
    Picker,
    ProfileHandler,
    ProfileResult,
    ProfileRunner,
    ResponseHeaders,
    Scorer,
)
from extproc.scheduling.registry import ENTRY_POINT_GROUP, PluginRegistry


class PluginParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """Base for a plugin's parameters: frozen, and a misspelt key is a config error (the
    registry refuses a `Params` class that would accept unknown keys). Subclass it and declare
    fields with defaults; use `typing.Annotated[..., msgspec.Meta(ge=0)]` for ranges."""


__all__ = [
    "ENTRY_POINT_GROUP",
    "Api",
    "Candidate",
    "ConfigError",
    "Decision",
    "Endpoint",
    "EndpointState",
    "Filter",
    "InferenceRequest",
    "MediaItem",
    "Message",
    "Modality",
    "Observer",
    "Part",
    "Picker",
    "PluginParams",
    "PluginRegistry",
    "ProfileHandler",
    "ProfileResult",
    "ProfileRunner",
    "Prompt",
    "ResponseHeaders",
    "Scorer",
]
