"""A local stand-in for the Kubernetes API server: the list and watch endpoints for Pods and
InferencePools in one namespace, with the knobs a watch client must survive (bookmarks,
compaction -> 410 Gone, dropped connections, restarts)."""

from __future__ import annotations

import asyncio
import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from aiohttp import web

from extproc.config import DiscoverySettings
from extproc.stack import free_port

NS = "ns"
POOLS = f"/apis/inference.networking.k8s.io/v1/namespaces/{NS}/inferencepools"
PODS = f"/api/v1/namespaces/{NS}/pods"


def pool_discovery(tmp_path: Path, server: str, pool_name: str = "pool") -> DiscoverySettings:
    """Discovery settings that watch InferencePool `pool_name` in NS on the API server at
    `server` (a kubeconfig with a token, written under `tmp_path`)."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [{"name": "c", "cluster": {"server": server}}],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    return DiscoverySettings(inference_pool=pool_name, namespace=NS, kubeconfig=str(path))


_END = object()  # end the stream normally (like timeoutSeconds)
_DROP = object()  # cut the connection


def pod(
    name: str,
    ip: str,
    labels: dict[str, str] | None = None,
    *,
    ready: bool = True,
    deleting: bool = False,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": NS, "labels": labels or {"app": "vllm"}}
    if deleting:
        meta["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": meta,
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "podIPs": [{"ip": ip}] if ip else [],
            "conditions": [
                {"type": "PodScheduled", "status": "True"},
                {"type": "Ready", "status": "True" if ready else "False"},
            ],
        },
    }


def pool(
    name: str = "pool", selector: dict[str, str] | None = None, ports: tuple[int, ...] = (8000,)
) -> dict[str, Any]:
    return {
        "apiVersion": "inference.networking.k8s.io/v1",
        "kind": "InferencePool",
        "metadata": {"name": name, "namespace": NS},
        "spec": {
            "selector": {"matchLabels": selector or {"app": "vllm"}},
            "targetPorts": [{"number": p} for p in ports],
            "endpointPickerRef": {"name": "extproc", "port": {"number": 9002}},
        },
    }


@dataclass
class _Watcher:
    path: str
    name: str | None
    queue: asyncio.Queue[Any] = field(default_factory=asyncio.Queue)


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}  # fmt: skip


class FakeKube:
    """Objects by (collection path, name), a global resourceVersion counter and an event log.
    Watches from a resourceVersion older than `compacted_rv` get 410 Gone, as an HTTP status
    or (with `gone_in_stream`) as an ERROR event, like a real API server does either way."""

    def __init__(self) -> None:
        self.rv = 100
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.log: list[tuple[int, str, str, dict[str, Any]]] = []
        self.compacted_rv = 0
        self.gone_in_stream = False
        self.requests: list[tuple[str, dict[str, str]]] = []
        self.watchers: list[_Watcher] = []
        self.auth: list[str | None] = []
        self.port = free_port()
        self._runner: web.AppRunner | None = None

    # --- state changes ---------------------------------------------------------------------

    def put(self, path: str, obj: dict[str, Any]) -> None:
        obj = copy.deepcopy(obj)
        name = obj["metadata"]["name"]
        kind = "MODIFIED" if (path, name) in self.objects else "ADDED"
        self.rv += 1
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self.objects[(path, name)] = obj
        self._emit(path, kind, obj)

    def delete(self, path: str, name: str) -> None:
        obj = self.objects.pop((path, name))
        self.rv += 1
        obj = copy.deepcopy(obj)
        obj["metadata"]["resourceVersion"] = str(self.rv)
        self._emit(path, "DELETED", obj)

    def bump(self, n: int = 1) -> None:
        """Other collections changed: the global resourceVersion moves on."""
        self.rv += n

    def bookmark(self) -> None:
        for w in self.watchers:
            kind = "InferencePool" if w.path == POOLS else "Pod"
            obj = {"kind": kind, "metadata": {"resourceVersion": str(self.rv)}}
            w.queue.put_nowait({"type": "BOOKMARK", "object": obj})

    def compact(self) -> None:
        """Forget history: every resourceVersion handed out so far is now too old."""
        self.compacted_rv = self.rv + 1

    def expire_watches(self) -> None:
        """Open watches receive an ERROR event with code 410."""
        for w in self.watchers:
            obj = _status(410, "Expired", "too old resource version")
            w.queue.put_nowait({"type": "ERROR", "object": obj})

    def end_watches(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(_END)

    def drop_watches(self) -> None:
        for w in self.watchers:
            w.queue.put_nowait(_DROP)

    def watch_rvs(self, path: str) -> list[str]:
        return [p.get("resourceVersion", "") for q, p in self.requests
                if q == path and p.get("watch")]  # fmt: skip

    def list_count(self, path: str) -> int:
        return sum(1 for q, p in self.requests if q == path and not p.get("watch"))

    def _emit(self, path: str, kind: str, obj: dict[str, Any]) -> None:
        self.log.append((self.rv, path, kind, obj))
        for w in self.watchers:
            if w.path == path and w.name in (None, obj["metadata"]["name"]):
                w.queue.put_nowait({"type": kind, "object": obj})

    # --- server ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get(POOLS, self._handle)
        app.router.add_get(PODS, self._handle)
        # Any other collection the test put objects in before start (e.g. objectives).
        for path in sorted({p for p, _ in self.objects} - {POOLS, PODS}):
            app.router.add_get(path, self._handle)
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=0.1)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port, reuse_address=True).start()

    async def stop(self) -> None:
        self.drop_watches()
        await asyncio.sleep(0)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        params = dict(request.query)
        path = request.path
        self.requests.append((path, params))
        self.auth.append(request.headers.get("Authorization"))
        name = None
        if sel := params.get("fieldSelector"):
            key, _, name = sel.partition("=")
            assert key == "metadata.name", sel
        if params.get("watch"):
            return await self._watch(request, path, name, params)
        items = sorted(
            (o for (p, n), o in self.objects.items() if p == path and name in (None, n)),
            key=lambda o: o["metadata"]["name"],
        )
        offset = int(params.get("continue") or 0)
        limit = int(params.get("limit") or 0) or len(items) or 1
        page = items[offset : offset + limit]
        more = offset + limit < len(items)
        kind = "InferencePoolList" if path == POOLS else "PodList"
        meta = {"resourceVersion": str(self.rv), "continue": str(offset + limit) if more else ""}
        return web.json_response({"kind": kind, "metadata": meta, "items": page})

    async def _watch(
        self, request: web.Request, path: str, name: str | None, params: dict[str, str]
    ) -> web.StreamResponse:
        since = int(params.get("resourceVersion") or 0)
        too_old = since < self.compacted_rv
        if too_old and not self.gone_in_stream:
            return web.json_response(_status(410, "Expired", "too old"), status=410)
        watcher = _Watcher(path, name)
        if too_old:
            watcher.queue.put_nowait({"type": "ERROR", "object": _status(410, "Expired", "old")})
        else:
            for rv, p, kind, obj in self.log:
                if rv > since and p == path and name in (None, obj["metadata"]["name"]):
                    watcher.queue.put_nowait({"type": kind, "object": obj})
        self.watchers.append(watcher)
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            while True:
                item = await watcher.queue.get()
                if item is _END:
                    break
                if item is _DROP:
                    assert request.transport is not None
                    request.transport.abort()
                    return resp
                await resp.write(json.dumps(item).encode() + b"\n")
            await resp.write_eof()
        except ConnectionError:
            pass
        finally:
            self.watchers.remove(watcher)
        return resp
