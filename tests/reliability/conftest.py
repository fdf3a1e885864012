"""Fault-injection tests: each kills, slows or corrupts one dependency under load and prints
the figure it proves (docs/reliability.md collects them). They assert behaviour (no failed
request, convergence, degraded flags); timings are printed, bounded loosely or not at all."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/reliability/" in str(item.fspath):
            item.add_marker(pytest.mark.reliability)


def figure(name: str, **values: object) -> None:
    """One line a reader (and docs/reliability.md) can grep: `FIGURE <name> k=v ...`."""
    print(f"\nFIGURE {name} " + " ".join(f"{k}={v}" for k, v in values.items()), flush=True)


def pytest_configure(config):
    config.addinivalue_line("markers", "reliability: fault injection under load (figures)")
