"""A bug met by every request (here: routing raises) answers each one 500, counts each in
`extproc_internal_errors_total`, and logs one traceback per exception type per interval, the
next line saying how many were left out."""

from __future__ import annotations

import logging

import httpx
import orjson
import pytest

from extproc.server.app import App
from extproc.testing import ExtProcClient, body_chunks, post, request_headers

CHAT = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]})


async def test_internal_errors_are_counted_each_and_logged_once_per_interval(
    app: App, client: ExtProcClient, caplog: pytest.LogCaptureFixture, monkeypatch
):
    async def broken(*_args, **_kwargs):
        raise RuntimeError("a bug every request meets")

    monkeypatch.setattr(app.router, "route", broken)
    with caplog.at_level(logging.ERROR, logger="extproc.server.stream"):
        for _ in range(20):
            out = await client.exchange(
                [request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)]
            )
            assert out[-1].immediate_response.status.code == 500
        # The interval passes: the next one is said again, with how many were not.
        assert app.stream_handler is not None
        last = app.stream_handler._throttle._last
        for key in last:
            last[key] -= 11.0
        await client.exchange([request_headers(post("/v1/chat/completions")), *body_chunks(CHAT)])
    said = [r for r in caplog.records if r.getMessage() == "internal error"]
    assert len(said) == 2
    assert all(r.exc_info is not None for r in said)
    assert [getattr(r, "suppressed_since_last", None) for r in said] == [0, 19]
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://127.0.0.1:{app.admin_port}/metrics")).text
    assert "extproc_internal_errors_total 21.0" in text
