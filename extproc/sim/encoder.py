"""One server's encoder cache: which media items (by content hash) have encoder outputs
ready, least recently used first. A miss costs encode time (see `timing`)."""

from __future__ import annotations

from collections import OrderedDict


class EncoderCache:
    """LRU set of media content hashes, at most `capacity_items` (0 disables caching)."""

    def __init__(self, capacity_items: int) -> None:
        if capacity_items < 0:
            raise ValueError("capacity_items must be >= 0")
        self.capacity_items = capacity_items
        self._items: OrderedDict[str, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._items)

    def hashes(self) -> list[str]:
        return list(self._items)

    def touch(self, content_hash: str) -> bool:
        """Marks the item as used; True when it was already cached (a hit)."""
        if content_hash in self._items:
            self._items.move_to_end(content_hash)
            return True
        if self.capacity_items:
            if len(self._items) >= self.capacity_items:
                self._items.popitem(last=False)
            self._items[content_hash] = None
        return False

    def clear(self) -> None:
        self._items.clear()
