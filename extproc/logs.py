"""Log formatting for the process: one JSON object per line (for log pipelines) or plain text
(for a terminal). `cli.py` calls `configure` once; library modules only use `logging`.

A record's `extra={...}` fields become top-level JSON keys, so `log.info("rejected",
extra={"request_id": rid, "status": 429})` is searchable by request id. Request bodies are
never passed to a logger by the picker (the explain dump logged at DEBUG carries scores and
block counts, not content).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Literal, TextIO

import orjson

LogFormat = Literal["json", "text"]

# Attributes every LogRecord has; anything else on a record came from `extra`.
_RESERVED = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)


class JsonFormatter(logging.Formatter):
    """One JSON object per line: `ts` (RFC 3339, UTC, milliseconds), `level`, `logger`,
    `message`, `request_id` (null when the record has none), every `extra` field, and
    `exc_info` as text when an exception is attached."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", None),
        }
        for key, value in vars(record).items():
            if key not in _RESERVED and key not in out:
                out[key] = value
        if record.exc_info:
            out["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack_info"] = self.formatStack(record.stack_info)
        # default=str: an `extra` value orjson cannot encode (a Path, an enum) still logs.
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """`time level logger message key=value ...`: the `extra` fields stay visible in text."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extras = [
            f"{k}={v}" for k, v in vars(record).items() if k not in _RESERVED and v is not None
        ]
        if not extras:
            return line
        head, sep, tail = line.partition("\n")  # keep a traceback below the fields
        return f"{head} {' '.join(extras)}{sep}{tail}"


class _Fields(logging.Filter):
    """Adds fixed fields (a worker's index) to every record that lacks them."""

    def __init__(self, fields: Mapping[str, object]) -> None:
        super().__init__()
        self._fields = dict(fields)

    def filter(self, record: logging.LogRecord) -> bool:
        for key, value in self._fields.items():
            if not hasattr(record, key):
                setattr(record, key, value)
        return True


def configure(
    level: str = "INFO",
    fmt: LogFormat = "text",
    stream: TextIO | None = None,
    *,
    fields: Mapping[str, object] | None = None,
) -> None:
    """Replace the root logger's handlers with one writing `fmt` lines to `stream`
    (stderr by default), each record carrying `fields` too. Raises ValueError for an unknown
    level or format."""
    if fmt not in ("json", "text"):
        raise ValueError(f"unknown log format {fmt!r}: use json or text")
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    handler = logging.StreamHandler(stream or sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    if fields:
        handler.addFilter(_Fields(fields))
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
