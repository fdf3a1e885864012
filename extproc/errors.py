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


class ExtprocError(Exception):
    status: int = 500
    code: str = "internal_error"
    type: str = "server_error"

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
    """Invalid configuration, found at load time. The message names the offending field."""
