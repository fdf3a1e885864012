"""Regenerate the committed protobuf modules: `uv run python protos/generate.py [OUT_DIR]`.

Output defaults to extproc/_proto/. tests/test_protos.py regenerates into a temporary folder
and fails if the committed files differ.
"""

from __future__ import annotations

import sys
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent
PROTOS = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.proto"))


def generate(out_dir: Path) -> None:
    out_dir.mkdir(parents=True, exist_ok=True)
    include = Path(protoc.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{ROOT}",
        f"-I{include}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        *PROTOS,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")


if __name__ == "__main__":
    generate(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT.parent / "extproc" / "_proto")
