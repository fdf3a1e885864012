"""The global KV-block index: who holds which block keys (see `base.KVIndex`).

Only the backend-free contract is re-exported here, so `scheduling/` can import it without
pulling in redis or zmq: import `index.memory`, `index.redis`, `index.subscriber` explicitly.
"""

from extproc.index.base import (
    GroupKind,
    GroupSpec,
    IndexOptions,
    IndexStats,
    KVIndex,
    Lookup,
)

__all__ = ["GroupKind", "GroupSpec", "IndexOptions", "IndexStats", "KVIndex", "Lookup"]
