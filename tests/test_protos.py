"""The committed generated code is what protos/ produces today, and it is upb-backed."""

from __future__ import annotations

import filecmp
import subprocess
import sys
from pathlib import Path

from google.protobuf.internal import api_implementation

ROOT = Path(__file__).resolve().parents[1]


def test_generated_code_is_fresh(tmp_path: Path):
    subprocess.run(
        [sys.executable, str(ROOT / "protos" / "generate.py"), str(tmp_path)], check=True
    )
    committed = ROOT / "extproc" / "_proto"
    fresh = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*_pb2.py*"))
    assert fresh, "protoc produced nothing"
    stale = [str(p) for p in fresh if not filecmp.cmp(tmp_path / p, committed / p, shallow=False)]
    assert stale == [], f"regenerate with `uv run python protos/generate.py`: {stale}"


def test_protobuf_runs_on_upb():
    assert api_implementation.Type() == "upb"
