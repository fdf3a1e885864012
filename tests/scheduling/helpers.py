"""Candidates and requests for scheduling tests: the builders plugin authors get from
`extproc.testing`, under the short names these tests use."""

from __future__ import annotations

from typing import Any

from extproc.core import Candidate
from extproc.testing import make_candidate
from extproc.testing import make_request as req

__all__ = ["addrs", "cand", "req"]


def cand(addr: str, *, prefix: float = 0.0, **kw: Any) -> Candidate:
    return make_candidate(addr, prefix_blocks=prefix, **kw)


def addrs(cands) -> list[str]:
    return [c.endpoint.address for c in cands]
