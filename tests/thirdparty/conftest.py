"""The `site/` folder is a tiny installed distribution (package + dist-info with an entry point),
put on sys.path so `importlib.metadata` finds it the way it finds a pip-installed plugin."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

SITE = Path(__file__).parent / "site"


@pytest.fixture
def plugin_site(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    monkeypatch.syspath_prepend(str(SITE))
    # Child processes (`extproc serve`) find it through PYTHONPATH.
    monkeypatch.setenv("PYTHONPATH", str(SITE))
    yield SITE
