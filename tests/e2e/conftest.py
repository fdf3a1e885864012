"""End-to-end fixtures: real Envoy, the real extproc process, echo upstreams."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from extproc.stack import Stack, StackOptions


def pytest_collection_modifyitems(items):
    for item in items:
        if "tests/e2e/" in str(item.fspath):
            item.add_marker(pytest.mark.e2e)


@pytest.fixture(scope="module")
def stack() -> Iterator[Stack]:
    with Stack(StackOptions(upstreams=3, unlisted_upstreams=1)) as s:
        yield s


@pytest.fixture
def http(stack: Stack) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=stack.url, timeout=30) as c:
        yield c
