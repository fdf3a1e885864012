"""InferenceObjective priorities watched through the Kubernetes list/watch API (the local
stand-in server), as flow control reads them."""

from __future__ import annotations

import asyncio

from extproc.endpoints.kubernetes import ApiServer
from extproc.endpoints.objectives_watch import InferenceObjectiveWatch
from tests.endpoints.fakekube import NS, FakeKube

OBJECTIVES = f"/apis/llm-d.ai/v1alpha2/namespaces/{NS}/inferenceobjectives"


def objective(name: str, priority: int | None, pool: str = "pool") -> dict:
    spec: dict = {"poolRef": {"name": pool, "group": "inference.networking.k8s.io"}}
    if priority is not None:
        spec["priority"] = priority
    return {
        "apiVersion": "llm-d.ai/v1alpha2",
        "kind": "InferenceObjective",
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
    }


async def test_priorities_of_our_pool_follow_the_cluster():
    kube = FakeKube()
    kube.put(OBJECTIVES, objective("critical", 10))
    kube.put(OBJECTIVES, objective("default", None))
    kube.put(OBJECTIVES, objective("elsewhere", 99, pool="other"))
    await kube.start()
    tables: list[dict[str, int]] = []
    watch = InferenceObjectiveWatch(ApiServer(kube.url), NS, "pool", tables.append)
    task = asyncio.create_task(watch.run())
    try:
        async with asyncio.timeout(5):
            await watch.synced.wait()
        assert tables[-1] == {"critical": 10, "default": 0}
        kube.put(OBJECTIVES, objective("batch", -1))
        kube.delete(OBJECTIVES, "critical")
        async with asyncio.timeout(5):
            while tables[-1] != {"default": 0, "batch": -1}:
                await asyncio.sleep(0.01)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        await kube.stop()
