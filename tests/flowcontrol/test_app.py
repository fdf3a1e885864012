"""Flow control inside the App: off by default; with InferencePool discovery, priorities
follow the cluster's InferenceObjectives; the metrics appear on the admin port."""

from __future__ import annotations

import asyncio

import httpx
import msgspec

from extproc.endpoints import parse_endpoints
from extproc.flowcontrol.config import FlowControlSettings
from extproc.server.app import App
from tests.endpoints.fakekube import PODS, POOLS, FakeKube, pod, pool, pool_discovery
from tests.endpoints.test_objectives_watch import OBJECTIVES, objective


async def test_off_by_default(app: App):
    assert app.admission is None and app.router.admission is None


async def test_objectives_from_kubernetes_and_metrics(settings, tmp_path):
    kube = FakeKube()
    kube.put(POOLS, pool(ports=(8000,)))
    kube.put(PODS, pod("a", "127.0.1.1"))
    kube.put(OBJECTIVES, objective("critical", 10))
    await kube.start()
    s = msgspec.structs.replace(
        settings,
        endpoints=[],
        discovery=pool_discovery(tmp_path, kube.url),
        flow_control=FlowControlSettings(),
    )
    try:
        async with App(s, []) as app:
            assert app.admission is not None
            objectives = app.admission.objectives
            async with asyncio.timeout(5):
                while objectives.table != {"critical": 10}:
                    await asyncio.sleep(0.02)
            assert objectives.priority({"x-llm-d-inference-objective": "critical"}) == 10
            async with httpx.AsyncClient() as c:
                text = (await c.get(f"http://127.0.0.1:{app.admin_port}/metrics")).text
            assert "extproc_flow_saturation" in text
            assert "extproc_flow_queue_wait_seconds" in text
            # Both Kubernetes watches' counters, told apart by resource.
            for resource in ("inferencepool", "inferenceobjective"):
                assert f'extproc_discovery_lists_total{{resource="{resource}"}}' in text
    finally:
        await kube.stop()


async def test_per_endpoint_admission_judges_only_endpoints_the_router_may_use(settings):
    # A server whose metrics stopped answering is routed around; admitting a request for
    # it (the only one with room) placed the request on another, full server.
    s = msgspec.structs.replace(
        settings,
        endpoints=["127.0.0.1:1", "127.0.0.1:2"],
        flow_control=FlowControlSettings(admit_per_endpoint=True),
    )
    async with App(s, parse_endpoints(",".join(s.endpoints))) as app:
        assert app.admission is not None
        judged = app.admission.controller._endpoints
        assert judged is not None
        assert [a for a, _ in judged()] == ["127.0.0.1:1", "127.0.0.1:2"]
        app.router._is_failing = lambda a: a == "127.0.0.1:2"
        assert [a for a, _ in judged()] == ["127.0.0.1:1"]
        # The pool's saturation still counts every endpoint.
        assert len(app.admission._states()) == 2
