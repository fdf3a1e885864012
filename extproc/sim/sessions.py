"""Closed-loop agentic sessions: long contexts that grow turn by turn on a shared agent prompt.

Every session starts from the same agent system prompt (tools, instructions), gets a task,
then runs `turns` tool-call rounds: each turn's prompt is the previous one plus the
assistant's tool call and the tool's (long) output, so a session's context grows to many
thousand tokens and its tail only exists where it was computed:

    agent prompt ─┬─ session 0: task ─ call ─ result ─ call ─ result ...   (turn k = k rounds)
                  └─ session 1: task ─ call ─ result ...

Agents declare their tools on every request (`tools`, as OpenAI and Anthropic agents do) and
the assistant turns are tool calls answered by `role: tool` results; with `tools=False` the
same words go as plain assistant and user turns (an agent that declares nothing, the
workload before issue 14's twenty-fifth session). The simulator's chat template renders
both the tool definitions and the calls, so token counts cover them.

Closed loop: a session sends its next turn only when the previous answer has arrived plus
`think_s` (the tool running), like an agent does; sessions start `stagger_s` apart. The
bodies are fixed by the seed (the assistant turns are workload text, not the server's
output), so every policy sees the same trace.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from extproc.sim.workload import Result, WorkItem, _text, _vocabulary, send_one


@dataclass(frozen=True, slots=True)
class AgenticSpec:
    """Sizes in words (~3 sim tokens each). `header_words`: a chat-template-like header every
    session (and every other workload built with the same seed) shares before the agent
    prompt."""

    sessions: int = 8
    turns: int = 12
    agent_words: int = 1000
    task_words: int = 60
    call_words: int = 30
    result_words: int = 700
    max_tokens: int = 32
    think_s: float = 0.2
    stagger_s: float = 0.3
    header_words: int = 0
    model: str = "tiny"
    seed: int = 0
    tools: bool = True


# The tools every agent declares: two small definitions (~390 sim tokens), the same for every
# session and seed (the agent prompt after them carries the seed).
AGENT_TOOLS: tuple[dict[str, Any], ...] = (
    {
        "type": "function",
        "function": {
            "name": "run_shell",
            "description": "Run a shell command in the task's workspace; returns its output.",
            "parameters": {
                "type": "object",
                "properties": {"command": {"type": "string"}},
                "required": ["command"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file of the task's workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    },
)


def build_sessions(spec: AgenticSpec) -> list[list[WorkItem]]:
    """Each session's turns in order. Deterministic in `spec`."""
    rng = random.Random(spec.seed)
    vocab = _vocabulary(rng)
    header = _text(rng, vocab, spec.header_words) + " " if spec.header_words else ""
    agent = header + f"agent seed {spec.seed}. " + _text(rng, vocab, spec.agent_words)
    out: list[list[WorkItem]] = []
    index = 0
    for s in range(spec.sessions):
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": agent},
            {"role": "user", "content": f"task {s}: " + _text(rng, vocab, spec.task_words)},
        ]
        turns = []
        for t in range(spec.turns):
            body: dict[str, Any] = {
                "model": spec.model,
                "messages": [dict(m) for m in messages],
                "max_tokens": spec.max_tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            }
            if spec.tools:
                body["tools"] = [dict(tool) for tool in AGENT_TOOLS]
            turns.append(WorkItem(index, 0, s, t, 0, body))
            index += 1
            call = "call " + _text(rng, vocab, spec.call_words)
            result = "result " + _text(rng, vocab, spec.result_words)
            rounds = _tool_round(s, t, call, result) if spec.tools else _plain_round(call, result)
            messages += rounds
        out.append(turns)
    return out


def _tool_round(session: int, turn: int, call: str, result: str) -> list[dict[str, Any]]:
    """An assistant turn calling a tool (the words as its argument) and the tool's result."""
    call_id = f"call_{session}_{turn}"
    function = {"name": "run_shell", "arguments": json.dumps({"command": call})}
    return [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"id": call_id, "type": "function", "function": function}],
        },
        {"role": "tool", "tool_call_id": call_id, "content": result},
    ]


def _plain_round(call: str, result: str) -> list[dict[str, Any]]:
    """The same words as plain turns: the assistant's text and the user's."""
    return [{"role": "assistant", "content": call}, {"role": "user", "content": result}]


async def run_closed_loop(
    sessions: Sequence[Sequence[WorkItem]],
    target: str | Callable[[WorkItem], str],
    *,
    think_s: float,
    stagger_s: float,
    timeout_s: float = 120.0,
) -> tuple[list[Result], float]:
    """Run every session (turn after turn, `think_s` between) concurrently; returns results
    in item-index order and the wall duration."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as http:
        loop = asyncio.get_running_loop()
        t0 = loop.time()

        async def session(k: int, turns: Sequence[WorkItem]) -> list[Result]:
            await asyncio.sleep(k * stagger_s)
            done = []
            for item in turns:
                url = target if isinstance(target, str) else target(item)
                res = await send_one(http, url, item, timeout_s)
                done.append(res)
                if res.status != 200:
                    break  # an agent whose call failed stops
                await asyncio.sleep(think_s)
            return done

        per = await asyncio.gather(*(session(k, t) for k, t in enumerate(sessions)))
        results = sorted((r for rs in per for r in rs), key=lambda r: r.index)
        return results, loop.time() - t0
