"""Client JSON -> `InferenceRequest`: API parsers, media sniffing and the one entry point
the server calls, `parse_request`."""

from extproc.requests.parse import parse_request
from extproc.requests.settings import ParseSettings

__all__ = ["ParseSettings", "parse_request"]
