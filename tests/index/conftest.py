"""Index fixtures: `kv_index` (a started index of each backend: memory, Redis, a 3-master
Cluster), each test in its own namespace, and a manual clock. The Redis servers come from
tests/redis_servers.py (fixtures `redis_server`, `redis_cluster` in tests/conftest.py).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import pytest

from extproc.index.base import IndexOptions
from extproc.index.memory import MemoryKVIndex
from extproc.index.redis import RedisKVIndex
from extproc.testing import ManualClock


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


_ns = itertools.count()


def unique_namespace() -> str:
    return f"t{next(_ns)}-{uuid.uuid4().hex[:8]}"


@dataclass
class IndexFactory:
    """Builds started indexes of one backend; every index it builds shares one store."""

    backend: str
    url: str | None
    namespace: str = field(default_factory=unique_namespace)
    _memory: MemoryKVIndex | None = None

    async def open(self, options: IndexOptions, **kwargs: object) -> MemoryKVIndex | RedisKVIndex:
        if self.backend == "memory":
            if self._memory is None:
                self._memory = MemoryKVIndex(options)
            return self._memory
        assert self.url is not None
        # Contract tests are about answers, not speed: on a loaded machine a 2048-key lookup
        # can pass the 5 ms production budget and answer degraded. Tests of the budget
        # itself pass their own.
        kwargs.setdefault("lookup_budget_s", 2.0)
        index = RedisKVIndex.from_url(
            self.url,
            cluster=self.backend == "cluster",
            options=options,
            namespace=self.namespace,
            **kwargs,
        )
        return await index.__aenter__()


@pytest.fixture(params=["memory", "redis", "cluster"])
async def index_factory(request: pytest.FixtureRequest) -> AsyncIterator[IndexFactory]:
    url = None
    if request.param == "redis":
        url = request.getfixturevalue("redis_server").url
    elif request.param == "cluster":
        url = request.getfixturevalue("redis_cluster").url
    factory = IndexFactory(request.param, url)
    opened: list[MemoryKVIndex | RedisKVIndex] = []
    real_open = factory.open

    async def tracked(options: IndexOptions, **kwargs: object) -> MemoryKVIndex | RedisKVIndex:
        index = await real_open(options, **kwargs)
        opened.append(index)
        return index

    factory.open = tracked  # type: ignore[method-assign]
    try:
        yield factory
    finally:
        for index in reversed(opened):
            await index.__aexit__(None, None, None)


@pytest.fixture
async def kv_index(index_factory: IndexFactory, clock: ManualClock) -> MemoryKVIndex | RedisKVIndex:
    """A started index of each backend, with a manual clock and a 60 s approximate TTL."""
    return await index_factory.open(IndexOptions(approx_ttl_s=60.0, clock=clock))
