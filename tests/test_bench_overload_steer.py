"""bench/overload_steer.py: the per-request steering figures bench/RESULTS.md quotes (which
interactive requests joined a server where an earlier one was short of its first token)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location(
    "overload_steer", ROOT / "bench" / "overload_steer.py"
)
assert _spec is not None and _spec.loader is not None
steer = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(steer)


def req(at: float, picker: int, endpoint: str, ttft: float = 0.3) -> dict:
    return {"at": at, "picker": picker, "endpoint": endpoint, "ttft": ttft,
            "engine": [0.0, 0.0, ttft]}  # fmt: skip


def test_joins_are_told_apart_by_whose_request_was_unfinished():
    trace = [
        req(0.0, 1, "X"),
        req(0.01, 2, "X"),  # the peer's X is unfinished, Y has none: a collision
        req(1.0, 1, "Y"),
        req(1.1, 1, "Y"),  # its own Y is unfinished, X has none
        req(2.0, 2, "X"),
        req(2.1, 1, "Y"),  # X busy (the peer's), Y free: went where none was
        req(5.0, 1, "X"),  # nothing unfinished: not counted
        {"at": 6.0, "picker": None, "endpoint": "X", "ttft": 0.1},  # no decision: skipped
    ]
    out = steer.steer_summary(trace, window=0.5)
    assert out["interactive"] == 7
    assert out["split"] == {"1": {"X": 2, "Y": 3}, "2": {"X": 2}}
    joined = {k: v["n"] for k, v in out["beside_unfinished"].items()}
    assert joined == {
        "joined peer's, a server had none": 1,
        "joined own's, a server had none": 1,
        "went to a server with none": 1,
    }
    assert out["pairs"] == {
        "two pickers, same server": 1,
        "one picker, same server": 1,
        "two pickers, other server": 1,
    }
