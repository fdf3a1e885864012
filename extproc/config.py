"""Settings: one frozen tree, decoded from YAML with unknown fields rejected.

A config file is either our own document (`server`, `parse`, `scheduling`, ...) or a bare
llm-d `EndpointPickerConfig`, which is taken as the `scheduling` section. `cli.py` folds
flags into these structs; nothing below it reads the environment.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import msgspec
import yaml

from extproc.errors import ConfigError
from extproc.requests import ParseSettings
from extproc.scheduling.config import EndpointPickerConfig

MiB = 1 << 20


class ServerSettings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The ext_proc server.

    `max_body_bytes`: larger request bodies get 413 (checked against content-length first,
    then while streaming; never buffered past it). `fallbacks`: how many extra endpoints the
    destination list carries after the pick (override-host mode walks them on retry; leave 0
    for ORIGINAL_DST, which takes exactly one address). `grace_s`: how long SIGTERM waits for
    open streams.
    """

    host: str = "0.0.0.0"
    port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9002
    health_port: Annotated[int, msgspec.Meta(ge=0, le=65535)] = 9003
    max_body_bytes: Annotated[int, msgspec.Meta(gt=0)] = 64 * MiB
    fallbacks: Annotated[int, msgspec.Meta(ge=0, le=16)] = 0
    grace_s: Annotated[float, msgspec.Meta(ge=0)] = 10.0


class Settings(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    endpoints: list[str] = msgspec.field(default_factory=list)
    server: ServerSettings = ServerSettings()
    parse: ParseSettings = ParseSettings()
    scheduling: EndpointPickerConfig | None = None


def load_settings(path: str | Path | None) -> Settings:
    """Decode a YAML file into Settings; `None` gives the defaults."""
    if path is None:
        return Settings()
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if doc is None:
        doc = {}
    if not isinstance(doc, dict):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    if doc.get("kind") == "EndpointPickerConfig":
        doc = {"scheduling": doc}
    try:
        return msgspec.convert(doc, Settings)
    except msgspec.ValidationError as exc:
        raise ConfigError(f"{path}: {exc}") from None
