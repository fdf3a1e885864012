"""Media identity: one content hash per asset, shared by the prefix stream, the precise
block keys and media affinity.

blake3 over the decoded bytes of inline media (so the same picture sent as base64 by two
clients is one asset), over the normalized URL string for remote media (never fetched).
"""

from __future__ import annotations

import blake3


def content_digest(data: bytes) -> bytes:
    """32-byte blake3 digest of an inline asset's decoded bytes."""
    return blake3.blake3(data).digest()


def url_digest(normalized_url: str) -> bytes:
    """32-byte blake3 digest of a remote asset's normalized URL (domain-separated from
    inline content, so a URL can never collide with bytes that spell it)."""
    return blake3.blake3(
        b"extproc/url\0" + normalized_url.encode("utf-8", "surrogatepass")
    ).digest()
