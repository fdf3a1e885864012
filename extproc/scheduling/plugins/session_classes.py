"""The fleet's recent first-turn fates per request class: `uncontinuedPrior`'s evidence.

`bounded-sessions-filter` with `uncontinuedPrior` reads a new session on a prefix nothing is
recorded under as one-shot while none of the fleet's recent first turns came back
(session_fates.py). One record for the whole fleet let one-shot traffic speak for agents: on
bench_routing's mixed workload (one-shot prompt groups, agents starting on a new prompt) the
one-shot outcomes said "nothing comes back" as the agents arrived, their first turns went
unbounded onto the prompt's holder, and their TTFT p90 was worse in 8 of 8 pairs
(bench/RESULTS.md, twenty-fourth session, priororder).

So the fates are kept per class of the first turn, and a new session reads its own class's:
a class whose first turns come back stays bounded, one whose never do is expected to grow 0.
A class is what the request says of itself before any later turn exists: its API, whether it
declares `tools` (OpenAI and Anthropic agents send them on every request; a one-shot prompt
seldom does) and whether it carries media (a document or images asked about once, against
text chat). At most 5 x 2 x 2 classes: each needs `_PRIOR_MIN` fates of its own before the
prior speaks for it, a few seconds of traffic. No class is taken to be agentic: a tool-less
agent shares its class with one-shot chat and is read as that class's outcomes say (the
twenty-fourth session's loss, still), and a tools class that never comes back gets the prior.

Placements from peer replicas carry the first turn's class (server/shared_sessions.py), so a
continuation placed anywhere counts for the class it belongs to. A continuation whose class
is not known (a peer too old to send it) counts as come back for every class: it can only
keep sessions bounded, as without the prior.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from extproc.core import Api, InferenceRequest

# The class of a first turn whose class is not known (a peer's placement without one).
UNKNOWN_CLASS = ""
# Classes remembered, the least recently told forgotten first: the classes of
# `session_class` are 20; a peer's forged ones must not grow the record.
_CLASSES = 32
# The classes' names, built once (a request's class is a dict lookup, not a string built).
_NAMES = {
    (api, tools, media): api.value + ("+tools" if tools else "") + ("+media" if media else "")
    for api in Api
    for tools in (False, True)
    for media in (False, True)
}


def session_class(req: InferenceRequest) -> str:
    """The request's class for the prior: its API, `+tools` when it declares tools, `+media`
    when it carries media (`chat+tools`, `completions`, `messages+tools+media`)."""
    tools = req.prompt is not None and bool(req.prompt.tools)
    return _NAMES[req.api, tools, bool(req.media)]


class ClassOutcomes:
    """The last `keep` first-turn fates of each class (True: continued; False: no later
    turn within the horizon)."""

    def __init__(self, keep: int, least: int) -> None:
        self._keep = keep
        self._least = least
        self._fates: OrderedDict[str, deque[bool]] = OrderedDict()

    def add(self, cls: str, continued: bool) -> None:
        """One first turn's fate. A continuation of `UNKNOWN_CLASS` counts for every class."""
        if cls == UNKNOWN_CLASS and continued:
            for fates in self._fates.values():
                fates.append(True)
        fates = self._fates.pop(cls) if cls in self._fates else deque(maxlen=self._keep)
        fates.append(continued)
        self._fates[cls] = fates
        while len(self._fates) > _CLASSES:
            self._fates.popitem(last=False)

    def come_back(self, cls: str) -> bool | None:
        """True while one of the class's last fates is a continuation; False while all of
        them (at least `least`) went uncontinued; None: fewer known."""
        fates = self._fates.get(cls)
        if fates is None:
            return None
        if any(fates):
            return True
        return False if len(fates) >= self._least else None
