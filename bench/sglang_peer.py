"""sglang-router, the in-path peer the benchmarks compare against, installed on demand."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path


def _uv() -> str | None:
    """uv on PATH, or the one scripts/uv.sh installs under the cache when none is (this
    machine's case: without it the peer was skipped with FileNotFoundError)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tools = cache / "extproc" / "uv-venv" / "bin" / "uv"
    return shutil.which("uv") or (str(tools) if tools.exists() else None)


def install_sglang(tmp: Path) -> tuple[Path | None, str]:
    """sglang-router into a throwaway venv (uv); never into the project. Returns the venv and
    the installed version, or None and why it was skipped."""
    venv = tmp / "sglang-venv"
    uv = _uv()
    if uv is None:
        return None, "sglang-router skipped: no uv (on PATH or from scripts/uv.sh)"
    try:
        subprocess.run([uv, "venv", "-q", str(venv)], check=True, timeout=120,
                       capture_output=True)  # fmt: skip
        subprocess.run([uv, "pip", "install", "-q", "--python", str(venv / "bin" / "python"),
                        "sglang-router"], check=True, timeout=600,
                       capture_output=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError) as exc:
        return None, f"sglang-router skipped: install failed ({type(exc).__name__})"
    out = subprocess.run([str(venv / "bin" / "python"), "-c",
                          "import importlib.metadata as m; print(m.version('sglang-router'))"],
                         capture_output=True, text=True)  # fmt: skip
    return venv, out.stdout.strip()
