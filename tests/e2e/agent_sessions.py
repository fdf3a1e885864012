"""Agent sessions on one system prompt, for the tests where a server loses its sessions'
tails (a restart, a cleared cache): each turn is answered before the next is sent, so only
the picker's session bound decides where a session goes, not the machine's speed."""

from __future__ import annotations

import random

import httpx

from extproc.stack import Stack
from tests.e2e.chat_turns import ChatTurns
from tests.e2e.test_session_spread import text


class AgentSessions:
    def __init__(self, http: httpx.Client, stack: Stack, rng: random.Random) -> None:
        self._http = http
        self._chat = ChatTurns(http, stack)
        self._metrics = f"http://127.0.0.1:{stack.picker_admin_port}/metrics"
        self._rng = rng
        self._agent = "You are a coding agent. " + text(rng, 600)
        self._histories: list[list[dict[str, str]]] = []

    def turn(self, s: int, content: str) -> str:
        """Session `s`'s next turn (a new session when `s` is new); where it went."""
        if s == len(self._histories):
            self._histories.append([{"role": "system", "content": self._agent}])
        else:
            self._histories[s].append({"role": "assistant", "content": f"ran step {s}"})
        self._histories[s].append({"role": "user", "content": content})
        return self._chat.send({"model": "tiny", "max_tokens": 2, "messages": self._histories[s]})

    def task(self, s: int, words: int = 80) -> str:
        """Session `s`'s task (its first turn when `s` is new)."""
        return self.turn(s, f"task {s}: " + text(self._rng, words))

    def tool(self, s: int, words: int, label: str = "") -> str:
        """A tool result as session `s`'s next turn."""
        return self.turn(s, f"tool result {s}{label}: " + text(self._rng, words))

    def two_growing(self) -> list[str]:
        """Two sessions whose second turns add a tool result over half the prompt's length:
        sessions on this prompt grow, so new ones are bounded, one per server. Their homes."""
        homes = []
        for s in range(2):
            homes.append(self.task(s))
            assert self.tool(s, 450) == homes[s]
        return homes

    def metric(self, name: str) -> float:
        """The picker's first sample whose line starts with `name` (0 when absent)."""
        lines = self._http.get(self._metrics).text.splitlines()
        return next((float(m.rsplit(" ", 1)[1]) for m in lines if m.startswith(name)), 0.0)
