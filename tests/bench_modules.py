"""Importing bench/ scripts (not a package: they import each other as siblings) in tests."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

BENCH = Path(__file__).resolve().parents[1] / "bench"


@contextlib.contextmanager
def bench_modules(*names: str) -> Iterator[tuple[ModuleType, ...]]:
    """The named bench scripts, imported with bench/ on the path while the block runs."""
    sys.path.insert(0, str(BENCH))
    try:
        yield tuple(importlib.import_module(n) for n in names)
    finally:
        sys.path.remove(str(BENCH))
