"""`App(..., grpc_ports=...)`: the ports a process serves on grpc.aio. A process that serves
ext_proc on another transport (issue 17's pyvoy measurements, `bench/picker_pyvoy.py`) binds
neither the ext_proc port nor, if asked, the health port, and still routes through the same
stream handler."""

from __future__ import annotations

import socket

import msgspec
import orjson
import pytest

from extproc.endpoints import parse_endpoints
from extproc.server.app import App
from extproc.server.health import SERVING
from extproc.stack import free_port
from extproc.testing import destination, post, request_body, request_headers
from tests.conftest import ENDPOINTS
from tests.server.test_rollout import status

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


class _Context:
    """The two things the stream handler asks of a servicer context."""

    def peer(self) -> str:
        return "ipv4:127.0.0.1:40000"

    async def abort(self, code, details):
        raise AssertionError(f"aborted: {code} {details}")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


async def _messages():
    yield request_headers(post("/v1/chat/completions"))
    yield request_body(CHAT, end_of_stream=True)


@pytest.mark.parametrize("ports", [frozenset(), frozenset({"health"})], ids=["none", "health"])
async def test_ports_not_served_on_grpc_stay_free_and_the_handler_routes(settings, ports):
    port, health_port = free_port(), free_port()
    s = msgspec.structs.replace(
        settings,
        server=msgspec.structs.replace(settings.server, port=port, health_port=health_port),
    )
    async with App(s, parse_endpoints(",".join(s.endpoints)), grpc_ports=ports) as app:
        assert app.port == 0 and _free(port)
        if "health" in ports:
            assert app.health_port == health_port
            assert await status(health_port, "readiness") == SERVING
        else:
            assert app.health_port == 0 and _free(health_port)
        assert app.ready()
        assert app.stream_handler is not None
        replies = [r async for r in app.stream_handler.process(_messages(), _Context())]
        assert destination(replies[0]) in ENDPOINTS
