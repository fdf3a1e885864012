"""Structured logs: one JSON object per line with the request id, levels from the command
line, and no request content in any log line (even at DEBUG)."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import orjson
import pytest

from extproc.cli import build_parser
from extproc.logs import JsonFormatter, TextFormatter, configure
from extproc.server.app import App
from extproc.testing import ExtProcClient, body_chunks, post, request_headers

SECRET = "tell-no-one-7f3a"


def record(msg: str, level: int = logging.INFO, **extra: object) -> logging.LogRecord:
    rec = logging.LogRecord("extproc.stream", level, __file__, 1, msg, (), None)
    for k, v in extra.items():
        setattr(rec, k, v)
    return rec


def test_json_line_has_ts_level_logger_message_request_id_and_extras():
    line = JsonFormatter().format(record("rejected", request_id="r-1", status=429))
    assert "\n" not in line
    doc = orjson.loads(line)
    assert doc["level"] == "INFO"
    assert doc["logger"] == "extproc.stream"
    assert doc["message"] == "rejected"
    assert doc["request_id"] == "r-1"
    assert doc["status"] == 429
    assert doc["ts"].endswith("+00:00")


def test_json_line_without_request_id_has_null_and_keeps_traceback_on_one_line():
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        import sys

        rec = record("internal error", logging.ERROR)
        rec.exc_info = sys.exc_info()
    line = JsonFormatter().format(rec)
    assert "\n" not in line
    doc = orjson.loads(line)
    assert doc["request_id"] is None
    assert "RuntimeError: boom" in doc["exc_info"]


def test_text_line_shows_extra_fields():
    line = TextFormatter().format(record("rejected", request_id="r-1", status=429))
    assert line.endswith("rejected request_id=r-1 status=429")


def test_configure_sets_level_and_format_and_rejects_unknown_ones():
    root = logging.getLogger()
    saved_handlers, saved_level = root.handlers[:], root.level
    out = io.StringIO()
    try:
        configure("warning", "json", out, fields={"worker": 1})
        logging.getLogger("extproc.x").info("hidden")
        logging.getLogger("extproc.x").warning("shown")
        lines = out.getvalue().splitlines()
        assert [orjson.loads(x)["message"] for x in lines] == ["shown"]
        assert orjson.loads(lines[0])["worker"] == 1
        with pytest.raises(ValueError):
            configure("loud", "json", out)
        with pytest.raises(ValueError):
            configure("INFO", "xml", out)
    finally:
        root.handlers[:] = saved_handlers
        root.setLevel(saved_level)


@pytest.mark.parametrize(
    "argv",
    [
        ["--log-format", "json", "--log-level", "DEBUG", "serve"],
        ["serve", "--log-format", "json", "--log-level", "DEBUG"],
    ],
)
def test_log_flags_work_before_and_after_the_subcommand(argv):
    args = build_parser().parse_args(argv)
    assert (args.log_format, args.log_level) == ("json", "DEBUG")


def test_log_flags_default_to_text_info():
    args = build_parser().parse_args(["serve"])
    assert (args.log_format, args.log_level) == ("text", "INFO")


@pytest.fixture
def debug_log() -> Iterator[io.StringIO]:
    """Every extproc record, at DEBUG, as JSON lines."""
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("extproc")
    saved = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    try:
        yield out
    finally:
        logger.removeHandler(handler)
        logger.setLevel(saved)


async def test_request_content_never_reaches_the_logs_even_at_debug(app: App, debug_log):
    good = orjson.dumps({"model": "m", "messages": [{"role": "user", "content": SECRET * 20}]})
    bad = orjson.dumps({"model": "m", "messages": SECRET})  # rejected with 400
    async with ExtProcClient(f"127.0.0.1:{app.port}") as c:
        for body in (good, bad, b"{" + SECRET.encode()):
            headers = post("/v1/chat/completions", {"x-request-id": "rid-42"})
            await c.exchange([request_headers(headers), *body_chunks(body)])
    text = debug_log.getvalue()
    lines = [orjson.loads(x) for x in text.splitlines()]
    assert any(x["message"] == "decision" for x in lines)  # DEBUG really was on
    rejected = [x for x in lines if x["message"] == "rejected"]
    assert len(rejected) == 2 and {x["request_id"] for x in rejected} == {"rid-42"}
    assert SECRET not in text
