"""Chat turns for the session-placement tests: sent through a Stack's Envoy (which simulated
server served it), or explained by the picker's admin port without being sent (what the
picker would decide now, with its reasons)."""

from __future__ import annotations

import httpx

from extproc.sim import SERVED_BY_HEADER
from extproc.stack import Stack

_CHAT = "/v1/chat/completions"


class ChatTurns:
    def __init__(self, http: httpx.Client, stack: Stack) -> None:
        self._http = http
        self._url = f"{stack.url}{_CHAT}"
        self._explain = f"http://127.0.0.1:{stack.picker_admin_port}/debug/explain"

    def send(self, body: dict) -> str:
        """Sends `body`; returns the address of the server that served it."""
        r = self._http.post(self._url, json=body)
        assert r.status_code == 200, r.text
        return r.headers[SERVED_BY_HEADER]

    def explain(self, body: dict) -> dict:
        """The picker's decision for `body` as JSON, nothing sent upstream."""
        r = self._http.post(self._explain, json=body, headers={"x-extproc-path": _CHAT})
        assert r.status_code == 200, r.text
        return r.json()
