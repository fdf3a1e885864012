"""The admin HTTP port (default 9090): Prometheus `/metrics`, and the read-only debug API
that `extproc explain` calls (`POST /debug/explain` replays a request against this picker's
live state without routing it; `GET /debug/state` shows endpoints and their figures).

Bound to loopback by default (`server.admin_host`): nothing here is authenticated, and the
explain API reveals every endpoint's score and prefix matches. Explain requests cannot stall
routing: bodies are capped (`server.admin_explain_max_bytes`, 413 past it), parsing and
hashing run in a worker thread, and one runs at a time (a second one gets 429 at once).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Mapping

import orjson
from aiohttp import web

from extproc.errors import ExtprocError
from extproc.protocol import EXPLAIN_PATH_HEADER
from extproc.router import Router
from extproc.server.metrics import PickerMetrics
from extproc.server.stream import explanation
from extproc.signals import Signals


def make_admin_app(
    router: Router,
    metrics: PickerMetrics,
    signals: Signals | None = None,
    *,
    max_body_bytes: int = 4 * 1024 * 1024,
) -> web.Application:
    busy = asyncio.Lock()

    async def get_metrics(request: web.Request) -> web.Response:
        return web.Response(
            body=metrics.exposition(), headers={"content-type": "text/plain; version=0.0.4"}
        )

    async def explain(request: web.Request) -> web.Response:
        if busy.locked():
            return web.json_response(
                {"error": {"message": "an explain request is running", "code": "busy"}},
                status=429,
            )
        async with busy:
            return await _explain(request)

    async def _explain(request: web.Request) -> web.Response:
        body = await request.read()  # aiohttp answers 413 past client_max_size
        headers = {k.lower(): v for k, v in request.headers.items()}
        path = headers.get(EXPLAIN_PATH_HEADER, "/v1/chat/completions")
        headers[":path"] = path
        try:
            parsed = await asyncio.to_thread(router.parse, path, headers, body)
            routed = await router.route_request(parsed, explain=True, place=False)
        except ExtprocError as err:
            return web.json_response(
                {"error": {"message": err.message, "code": err.code}}, status=err.status
            )
        return web.Response(body=orjson.dumps(explanation(routed)), content_type="application/json")

    async def state(request: web.Request) -> web.Response:
        inflight = router.inflight
        rows = []
        for e in router.pool.snapshot():
            s = router.states.state(
                e.address, inflight.requests(e.address), inflight.tokens(e.address)
            )
            rows.append(
                {
                    "address": e.address,
                    "name": e.name,
                    "labels": dict(e.labels),
                    "state": {
                        k: (
                            sorted(v)
                            if isinstance(v, frozenset)
                            else dict(v)
                            if isinstance(v, Mapping)
                            else v
                        )
                        # Field by field: asdict would deep-copy the read-only mappings.
                        for k, v in ((f.name, getattr(s, f.name)) for f in dataclasses.fields(s))
                    },
                }
            )
        return web.Response(
            body=orjson.dumps(
                {
                    "endpoints": rows,
                    "decisions": router.stats.decisions,
                    "signals": signals.as_dict() if signals is not None else None,
                }
            ),
            content_type="application/json",
        )

    app = web.Application(client_max_size=max_body_bytes)
    app.router.add_get("/metrics", get_metrics)
    app.router.add_post("/debug/explain", explain)
    app.router.add_get("/debug/state", state)
    return app
