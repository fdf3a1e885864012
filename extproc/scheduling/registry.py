"""Plugin registry: built-ins plus third-party plugins from the `extproc.plugins` entry-point
group, built by type name with strictly decoded parameters."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

import msgspec

from extproc.errors import ConfigError

ENTRY_POINT_GROUP = "extproc.plugins"


class PluginRegistry:
    """Maps plugin type names to classes. Built once at startup; never mutated after."""

    def __init__(self, classes: Iterable[type]) -> None:
        self._classes: dict[str, type] = {}
        for cls in classes:
            name = getattr(cls, "type_name", None)
            if not isinstance(name, str) or not hasattr(cls, "Params"):
                raise ConfigError(f"plugin class {cls!r} lacks type_name or Params")
            if name in self._classes and self._classes[name] is not cls:
                raise ConfigError(f"two plugins claim the type name {name!r}")
            self._classes[name] = cls

    @classmethod
    def default(cls, *, disabled: Iterable[str] = ()) -> PluginRegistry:
        """Built-ins plus installed entry points, minus `disabled` type names."""
        from extproc.scheduling.plugins import BUILTINS

        blocked = set(disabled)
        found = [ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP)]
        return cls(c for c in (*BUILTINS, *found) if c.type_name not in blocked)

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._classes))

    def get(self, type_name: str) -> type:
        try:
            return self._classes[type_name]
        except KeyError:
            known = ", ".join(self.type_names)
            raise ConfigError(f"unknown plugin type {type_name!r} (known: {known})") from None

    def build(self, type_name: str, parameters: Mapping[str, Any] | None, where: str) -> Any:
        cls = self.get(type_name)
        try:
            params = msgspec.convert(dict(parameters or {}), cls.Params)
        except msgspec.ValidationError as exc:
            raise ConfigError(f"{where}.parameters: {exc}") from None
        return cls(params)
