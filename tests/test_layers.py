"""Imports run one way, down the flow of a request (docs/architecture.md): a layer imports
only the layers below it, and the pure layers import no I/O library. A new package must be
placed here, which is the point: its place in the flow is a decision, not an accident."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "extproc"

# Pure helpers any layer may use: no extproc imports of their own (throttle: rate-limited
# logging, which every layer that meets a peer's or a file's garbage needs).
_BASE = {"core", "errors", "protocol", "backoff", "throttle"}
# package or top-level module -> the extproc packages/modules it may import
ALLOWED: dict[str, set[str]] = {
    "core": set(),
    "errors": set(),
    "protocol": set(),
    "backoff": set(),
    "logs": set(),
    "throttle": set(),  # rate-limited logging for what hostile peers can repeat
    "redis_client": {"errors"},
    "redis_loop": {"backoff"},  # how long-lived loops wait for, and stop around, Redis
    # a bounded snapshot of a channel's long-lived records, for replicas that start late
    "retained": set(),
    # a batched pub/sub channel between replicas
    "redis_broadcast": {"redis_client", "redis_loop", "retained", "throttle"},
    "hashing": _BASE,
    "requests": _BASE | {"hashing"},
    "latency": _BASE,
    "scheduling": _BASE | {"latency"},
    "plugins": _BASE | {"scheduling"},
    "index": _BASE | {"hashing", "redis_client", "redis_loop", "throttle"},
    "endpoints": _BASE | {"redis_broadcast", "redis_client", "redis_loop", "latency"},
    # Admission between the index lookup and scheduling: it reads endpoint state, its plugins
    # are built like scheduling plugins, and replicas share its state through Redis.
    "flowcontrol": _BASE | {"endpoints", "redis_client", "redis_loop", "scheduling"},
    "router": _BASE | {"hashing", "index", "endpoints", "scheduling", "flowcontrol", "throttle"},
    "config": _BASE | {"requests", "scheduling", "endpoints", "index", "hashing", "flowcontrol"},
    "calibration": _BASE | {"requests"},
    "signals": set(),
    "server": _BASE
    | {"_proto", "config", "endpoints", "hashing", "index", "requests", "router", "scheduling"}
    | {"logs", "redis_broadcast", "redis_client", "redis_loop", "flowcontrol", "latency"}
    | {"throttle", "retained"}
    | {"calibration", "signals"},
    "sim": _BASE | {"hashing", "requests"},
    "bootstrap": _BASE,
    "gateways": _BASE | {"bootstrap"},
    "stack": _BASE | {"bootstrap"},
    "demo": _BASE | {"sim", "stack"},
    "testing": _BASE | {"config", "endpoints", "scheduling", "server"},
    "cli": _BASE
    | {"bootstrap", "config", "demo", "endpoints", "logs", "scheduling", "server", "sim"},
    "__main__": {"cli"},
    "__init__": set(),
}
# The pure layers: no network, no event loop, no transport.
NO_IO = {"core", "errors", "backoff", "hashing", "requests", "scheduling", "plugins", "latency"}
IO_LIBRARIES = {"grpc", "redis", "zmq", "aiohttp", "asyncio", "socket", "httpx"}


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every absolute import in the file, function-level ones too."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


def _layer(path: Path) -> str:
    return path.relative_to(PACKAGE).parts[0].removesuffix(".py")


SOURCES = sorted(p for p in PACKAGE.rglob("*.py") if "_proto" not in p.parts)


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(PACKAGE)))
def test_each_module_imports_only_layers_below_it(path: Path):
    layer = _layer(path)
    assert layer in ALLOWED, f"{layer}: new package: give it a place in ALLOWED"
    wrong = []
    for line, module in _imports(path):
        parts = module.split(".")
        if parts[0] == "extproc" and len(parts) > 1:
            target = parts[1]
            if target != layer and target not in ALLOWED[layer]:
                wrong.append(f"line {line}: {module}")
        elif layer in NO_IO and parts[0] in IO_LIBRARIES:
            wrong.append(f"line {line}: {module} (I/O in a pure layer)")
    assert not wrong, f"{path.relative_to(PACKAGE)} imports upward: {wrong}"
