"""The debug API and `extproc explain`: replay a request against a running picker's live
state without routing it."""

from __future__ import annotations

import asyncio

import httpx
import msgspec
import orjson

from extproc.cli import main
from extproc.server.app import App
from tests.conftest import ENDPOINTS


async def test_explain_replays_without_placing_anything(app: App, tmp_path, capsys):
    body = tmp_path / "body.json"
    body.write_bytes(orjson.dumps({"model": "m", "messages": [{"role": "user", "content": "x"}]}))
    url = f"http://127.0.0.1:{app.admin_port}"
    rc = await asyncio.to_thread(main, ["explain", str(body), "--picker", url])
    assert rc == 0
    out = orjson.loads(capsys.readouterr().out)
    assert out["endpoints"][0] in ENDPOINTS
    assert "default/predicted-ttft-scorer" in out["scores"]
    assert set(out["scores"]["default/total"]) == set(ENDPOINTS)
    # A dry run: nothing was counted in flight, nothing learned.
    assert app.router.inflight.total() == 0
    assert app.router.stats.decisions == 0


async def test_explain_reports_a_bad_request_as_such(app: App, tmp_path, capsys):
    body = tmp_path / "bad.json"
    body.write_bytes(b"{not json")
    url = f"http://127.0.0.1:{app.admin_port}"
    assert await asyncio.to_thread(main, ["explain", str(body), "--picker", url]) == 1
    assert orjson.loads(capsys.readouterr().out)["error"]["code"] == "invalid_request"


async def test_debug_state_lists_endpoints_with_their_figures(app: App):
    async with httpx.AsyncClient() as http:
        r = await http.get(f"http://127.0.0.1:{app.admin_port}/debug/state")
    state = r.json()
    assert [e["address"] for e in state["endpoints"]] == list(ENDPOINTS)
    first = state["endpoints"][0]["state"]
    assert first["inflight_requests"] == 0 and first["is_stale"] is True
    assert msgspec.json.decode(r.content)["decisions"] == 0
