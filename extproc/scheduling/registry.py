"""Plugin registry: built-ins plus third-party plugins from the `extproc.plugins` entry-point
group, built by type name with strictly decoded parameters."""

from __future__ import annotations

import inspect
import re
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from typing import Any

import msgspec

from extproc.errors import ConfigError
from extproc.scheduling.conformance import check_plugin_class

ENTRY_POINT_GROUP = "extproc.plugins"


class PluginRegistry:
    """Maps plugin type names to classes. Built once at startup; never mutated after."""

    def __init__(self, classes: Iterable[type]) -> None:
        self._classes: dict[str, type] = {}
        for cls in classes:
            name = check_plugin_class(cls)
            if name in self._classes and self._classes[name] is not cls:
                raise ConfigError(
                    f"two plugins claim the type name {name!r}: "
                    f"{self._classes[name].__module__} and {cls.__module__}"
                )
            self._classes[name] = cls

    @classmethod
    def default(cls, *, disabled: Iterable[str] = ()) -> PluginRegistry:
        """Built-ins plus installed entry points, minus `disabled` type names."""
        from extproc.scheduling.plugins import BUILTINS

        blocked = set(disabled)
        # An entry point's name is its plugin's type name: a blocked one is never imported,
        # so a broken or unwanted package cannot run code at start-up.
        found = [
            ep.load() for ep in entry_points(group=ENTRY_POINT_GROUP) if ep.name not in blocked
        ]
        return cls(c for c in (*BUILTINS, *found) if c.type_name not in blocked)

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(sorted(self._classes))

    def get(self, type_name: str, where: tuple[str | int, ...] = ()) -> type[Any]:
        try:
            return self._classes[type_name]
        except KeyError:
            known = ", ".join(self.type_names)
            raise ConfigError(
                f"unknown plugin type {type_name!r} (known: {known})", path=(*where, "type")
            ) from None

    def build(
        self, type_name: str, parameters: Mapping[str, Any] | None, where: tuple[str | int, ...]
    ) -> Any:
        """An instance of `type_name` with `parameters` decoded strictly into its Params."""
        cls = self.get(type_name, where)
        try:
            params = msgspec.convert(dict(parameters or {}), cls.Params)
        except msgspec.ValidationError as exc:
            raise validation_error(exc, (*where, "parameters")) from None
        return cls(params)

    def describe(self) -> list[tuple[str, str]]:
        """(type name, docstring) of every plugin, for `extproc plugins`."""
        return [(n, inspect.getdoc(self._classes[n]) or "") for n in self.type_names]

    def parameters(self, type_name: str) -> tuple[tuple[str, Any], ...]:
        """(name as YAML spells it, default) of each parameter `type_name` accepts, read
        from its Params; `msgspec.NODEFAULT` where it has none (required)."""
        out = []
        for f in msgspec.structs.fields(self.get(type_name).Params):
            if f.default_factory is not msgspec.NODEFAULT:
                default = f.default_factory()
            else:
                default = f.default
            out.append((f.encode_name, default))
        return tuple(out)


def validation_error(exc: msgspec.ValidationError, prefix: tuple[str | int, ...]) -> ConfigError:
    """A msgspec error (`Object contains unknown field `x` - at `$.a[0]``) as a ConfigError
    located under `prefix`."""
    text = str(exc)
    message, sep, where = text.rpartition(" - at `")
    if not sep:
        message, where = text, "$`"
    path: list[str | int] = list(prefix)
    for m in re.finditer(r"\.([^.\[`]+)|\[(\d+)\]", where.rstrip("`")[1:]):
        path.append(m.group(1) if m.group(1) is not None else int(m.group(2)))
    unknown = re.fullmatch(r"Object contains unknown field `(.+)`", message)
    if unknown:
        # Point at the offending key itself, so the reported line is its line.
        path.append(unknown.group(1))
        message = "unknown field"
    return ConfigError(message, path=tuple(path))
