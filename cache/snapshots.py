"""Bounded host-memory store of State Cache snapshots, keyed by the chain hash of the block that
ends at the snapshot's position. Bookkeeping is plain LRU over byte sizes; the values are opaque
to it (lists of host tensors in practice)."""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, TypeVar

V = TypeVar("V")


class SnapshotStore(Generic[V]):
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._items: OrderedDict[bytes, tuple[V, int]] = OrderedDict()
        self.evictions = 0

    def __contains__(self, key: bytes) -> bool:
        return key in self._items

    def __len__(self) -> int:
        return len(self._items)

    def put(self, key: bytes, value: V, nbytes: int) -> bool:
        """Keep a snapshot, evicting the least recently used ones to make room."""
        if nbytes > self.max_bytes:
            return False
        if key in self._items:
            self._items.move_to_end(key)
            return True
        while self.used_bytes + nbytes > self.max_bytes:
            _, (_, size) = self._items.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1
        self._items[key] = (value, nbytes)
        self.used_bytes += nbytes
        return True

    def get(self, key: bytes) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        self._items.move_to_end(key)
        return item[0]

    def clear(self) -> None:
        self._items.clear()
        self.used_bytes = 0
