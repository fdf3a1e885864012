"""extproc: an Envoy ext_proc endpoint picker for LLM inference.

The public API for plugin authors is `extproc.plugins` (and `extproc.testing` for their
tests); everything else is internal and may change between releases.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("extproc")
except PackageNotFoundError:  # running from a source tree that was never installed
    __version__ = "0+unknown"

__all__ = ["__version__"]
