"""Errors that abort a request, each mapped to the HTTP status the client gets.

    ExtprocError (500)
     +-- BadRequest (400)        body or headers the picker cannot make sense of
     +-- PayloadTooLarge (413)   body past the configured limit
     +-- Overloaded (429)        shed on purpose (saturation)
     +-- NoEndpoints (503)       nothing eligible to route to

Messages are shown to clients: never put request content or internal detail in them.
Routine trouble (Redis down, stale metrics) is not an error: it is a value (see `core`).
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType


class ExtprocError(Exception):
    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"
    # The request's model when the body had parsed before the refusal (a metrics label).
    model: str | None = None
    # Headers sent with the error response (`retry-after` on a shed request).
    extra_headers: Mapping[str, str] = MappingProxyType({})

    def __init__(self, message: str = "internal error in the endpoint picker") -> None:
        super().__init__(message)
        self.message = message


class BadRequest(ExtprocError):
    status = 400
    code = "invalid_request"
    type = "invalid_request_error"


class PayloadTooLarge(ExtprocError):
    status = 413
    code = "request_too_large"
    type = "invalid_request_error"


class Overloaded(ExtprocError):
    status = 429
    code = "rejected-saturated"
    type = "rate_limit_error"


class NoEndpoints(ExtprocError):
    status = 503
    code = "no_eligible_endpoints"
    type = "server_error"


class ConfigError(Exception):
    """Invalid configuration, found at load time.

    `path` locates the offending field in the document (keys and list indexes), so the
    loader can name it and its line: `scheduling.plugins[2].parameters: unknown field`.
    """

    def __init__(self, message: str, *, path: tuple[str | int, ...] = ()) -> None:
        super().__init__(message)
        self.message = message
        self.path = path

    def within(self, *prefix: str | int) -> ConfigError:
        """The same error, located inside a parent document."""
        return ConfigError(self.message, path=(*prefix, *self.path))

    def __str__(self) -> str:
        return f"{format_path(self.path)}: {self.message}" if self.path else self.message


def format_path(path: tuple[str | int, ...]) -> str:
    out = ""
    for part in path:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else part)
    return out


class RequestTimeout(ExtprocError):
    """The body did not arrive within the body-read deadline (a slow or stalled client)."""

    status = 408
    code = "request_body_timeout"
    type = "invalid_request_error"


class StreamsFull(ExtprocError):
    """The picker already holds `server.max_streams` ext_proc streams open (each held to its
    response's end under a gateway's settings): a new request is refused, not queued."""

    status = 503
    code = "picker_streams_full"
    type = "server_error"
    extra_headers = MappingProxyType({"retry-after": "1"})


class BodyBudgetExhausted(ExtprocError):
    """Every stream together already buffers the configured total of body bytes."""

    status = 503
    code = "body_budget_exhausted"
    type = "server_error"
