"""InferenceObjective priorities watched in Kubernetes: name -> `spec.priority` of the
objectives whose `spec.poolRef.name` is our InferencePool (llm-d's CRD, group `llm-d.ai`,
version v1alpha2, plural `inferenceobjectives`; an unset priority is 0).

Same list-then-watch machinery as the InferencePool watch (resourceVersion kept across
reconnects, bookmarks, 410 -> re-list, backoff); `on_change` receives the whole table each
time it changes. Flow control reads priorities from it (docs/flow-control.md).
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Callable, Mapping

import aiohttp
import msgspec

from extproc.backoff import backoff_s
from extproc.endpoints.kubernetes import (
    ApiServer,
    ObjectMeta,
    Sleep,
    WatchStats,
    WatchTiming,
    _ListMeta,
    _Reflector,
)

log = logging.getLogger("extproc.kubernetes")

OBJECTIVE_GROUP = "llm-d.ai"
OBJECTIVE_VERSION = "v1alpha2"


class _PoolRef(msgspec.Struct, frozen=True):
    name: str = ""


class _ObjectiveSpec(msgspec.Struct, frozen=True):
    priority: int | None = None
    poolRef: _PoolRef = _PoolRef()


class InferenceObjective(msgspec.Struct, frozen=True):
    metadata: ObjectMeta = ObjectMeta()
    spec: _ObjectiveSpec = _ObjectiveSpec()


class InferenceObjectiveList(msgspec.Struct, frozen=True):
    metadata: _ListMeta = _ListMeta()
    items: list[InferenceObjective] = msgspec.field(default_factory=list)


class InferenceObjectiveWatch:
    """Background loop: the priorities of the InferenceObjectives of pool `namespace/pool`."""

    def __init__(
        self,
        api: ApiServer,
        namespace: str,
        pool: str,
        on_change: Callable[[Mapping[str, int]], None],
        *,
        timing: WatchTiming | None = None,
        sleep: Sleep = asyncio.sleep,
        rand: Callable[[], float] = random.random,
    ) -> None:
        self.api = api
        self.namespace = namespace
        self.pool = pool
        self.timing = timing or WatchTiming()
        self.sleep = sleep
        self.rand = rand
        self.stats = WatchStats()
        self.synced = asyncio.Event()
        self._on_change = on_change
        self._last: dict[str, int] | None = None
        path = (
            f"/apis/{OBJECTIVE_GROUP}/{OBJECTIVE_VERSION}/namespaces/{namespace}"
            "/inferenceobjectives"
        )
        self._objectives = _Reflector(
            self,
            "InferenceObjective",
            path,
            InferenceObjective,
            InferenceObjectiveList,
            {},
        )

    def backoff_s(self, failures: int) -> float:
        t = self.timing
        return backoff_s(failures, t.backoff_s, t.max_backoff_s, self.rand())

    async def run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timing.request_timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            await self._objectives.run(session)

    def _publish(self) -> None:
        if not self._objectives.synced:
            return
        table = {
            o.metadata.name: o.spec.priority or 0
            for o in self._objectives.items.values()
            if o.spec.poolRef.name == self.pool
        }
        if table == self._last:
            return
        self._last = table
        self.stats.changes += 1
        log.info("InferenceObjectives of %s/%s: %d", self.namespace, self.pool, len(table))
        self._on_change(table)
        self.synced.set()
