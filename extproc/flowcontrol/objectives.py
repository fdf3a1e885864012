"""Priorities by objective name: the `x-llm-d-inference-objective` header names an
InferenceObjective, whose `spec.priority` is the request's band (higher = more important;
unknown or absent = 0, as in llm-d).

The file holds InferenceObjective documents (one per YAML document, or a list / `items`),
or a plain mapping `name: priority`; it is re-read when its modification time changes, and a
file that no longer parses keeps the last good table (logged, counted). Without a file, with
InferencePool discovery, the table follows the cluster's InferenceObjectives instead.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from typing import Any

import yaml

from extproc.protocol import OBJECTIVE_HEADERS

log = logging.getLogger("extproc.flowcontrol")

DEFAULT_FAIRNESS_ID = "default-flow"


def parse_objectives(docs: list[Any]) -> dict[str, int]:
    """name -> priority from decoded YAML documents. Raises ValueError on a bad shape."""
    out: dict[str, int] = {}
    for doc in docs:
        if doc is None:
            continue
        if isinstance(doc, dict) and "items" in doc and isinstance(doc["items"], list):
            out.update(parse_objectives(doc["items"]))
        elif isinstance(doc, list):
            out.update(parse_objectives(doc))
        elif isinstance(doc, dict) and doc.get("kind") == "InferenceObjective":
            name = (doc.get("metadata") or {}).get("name")
            priority = (doc.get("spec") or {}).get("priority", 0)
            if not isinstance(name, str) or not isinstance(priority, int):
                raise ValueError("InferenceObjective needs metadata.name and an integer priority")
            out[name] = priority
        elif isinstance(doc, dict) and all(
            isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
            for k, v in doc.items()
        ):
            out.update(doc)
        else:
            raise ValueError("expected InferenceObjective documents or a name: priority mapping")
    return out


_NEVER = object()  # no failed version yet


class Objectives:
    """The objective table, reloaded from `path` when it changes (`refresh()`)."""

    def __init__(self, path: str | None = None, table: Mapping[str, int] | None = None) -> None:
        self.path = path
        self.table: dict[str, int] = dict(table or {})
        self.load_errors = 0
        self._mtime: float | None = None
        # The file version (mtime; None: missing) that last failed to load, so the reload
        # tick (once a second) says and counts a bad version once, not every second.
        self._failed: float | object | None = _NEVER
        if path is not None:
            self.refresh(strict=True)

    def refresh(self, *, strict: bool = False) -> None:
        if self.path is None:
            return
        mtime: float | None = None
        try:
            mtime = os.stat(self.path).st_mtime
            if mtime == self._mtime:
                return
            with open(self.path) as f:
                table = parse_objectives(list(yaml.safe_load_all(f)))
        except (OSError, ValueError, yaml.YAMLError) as exc:
            if strict:
                raise ValueError(f"{self.path}: {exc}") from None
            if mtime != self._failed:
                self._failed = mtime
                self.load_errors += 1
                log.warning("objectives file unreadable, keeping the last table: %s", exc)
            return
        self._failed = _NEVER
        self._mtime = mtime
        self.table = table
        log.info("objectives loaded", extra={"objectives": len(table)})

    def replace(self, table: Mapping[str, int]) -> None:
        """A new table from a Kubernetes watch (extproc.endpoints.objectives_watch)."""
        self.table = dict(table)

    def priority(self, headers: Mapping[str, str]) -> int:
        for h in OBJECTIVE_HEADERS:
            name = headers.get(h)
            if name:
                return self.table.get(name, 0)
        return 0


def first_header(headers: Mapping[str, str], names: tuple[str, ...]) -> str | None:
    for h in names:
        v = headers.get(h)
        if v:
            return v
    return None
