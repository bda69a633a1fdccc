"""The State Cache: per-request, fixed-size, position-sensitive state (every layer's window ring
and compressor tails), one slot per admitted request, never shared. Plain Python, no torch: the
tensors sit in `device_kv.DeviceKV`, indexed by slot.

- `SlotAllocator`: which slots are free.
- `HostSnapshots`: copies of a slot's state in host memory, each taken at a sealed block boundary
  and keyed by the chain hash of the block ending there (a bounded LRU; values are opaque here).
- `StateCache`: both, plus the restore policy. A prefix hit on blocks 0..h−1 restores the
  compressed context up to H = h·B, but the next token also needs every layer's window and
  compressor tail at H. They come from the cheapest valid point p ≤ H:
  - a snapshot at a sealed boundary kB (whichever mode wrote it: `full`, `periodic`, `auto` once
    the prefix is hot, a request's own mode, another daemon sharing the store), or
  - p = H − span from an empty state (always possible; all `zero` ever has): recomputing [p, H)
    while attention reads the cached entries is exact for layer ℓ from position
    p + (window−1)(ℓ+1) on, so every layer's state at H is exact.
  Tokens [p, H) are recomputed with their entries frozen (cached blocks are never written).
- `HotPrefixes` (mode `auto`): the chain nodes where prefix hits landed. A prefix nobody has asked
  for twice costs no snapshot writes (as `zero`); once it is hit, requests through it snapshot as
  `periodic` does, plus the hit's own boundary, so the next hit restores there instead of
  recomputing.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from v4serve.cache.config import CacheConfig

V = TypeVar("V")


class SlotAllocator:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError("the State Cache needs at least one slot")
        self.num_slots = num_slots
        # Lowest slot first: keeps the set of touched slots compact and ids predictable.
        self._free = list(range(num_slots - 1, -1, -1))
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        return len(self._used) / self.num_slots

    def allocate(self) -> int | None:
        if not self._free:
            return None
        slot = self._free.pop()
        self._used.add(slot)
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self._free.append(slot)
        self._free.sort(reverse=True)

    def check_integrity(self) -> None:
        assert len(self._free) + len(self._used) == self.num_slots
        assert not set(self._free) & self._used


class HostSnapshots(Generic[V]):
    """Bounded LRU over byte sizes; `on_evict(key, value)` hears of every entry that leaves."""

    def __init__(self, max_bytes: int, on_evict: Callable[[bytes, V], None] | None = None) -> None:
        self.max_bytes = max_bytes
        self.used_bytes = 0
        self._items: OrderedDict[bytes, tuple[V, int]] = OrderedDict()
        self.evictions = 0
        self._on_evict = on_evict

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
            old, (value, size) = self._items.popitem(last=False)
            self.used_bytes -= size
            self.evictions += 1
            if self._on_evict is not None:
                self._on_evict(old, value)
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
        if self._on_evict is not None:
            for key, (value, _) in self._items.items():
                self._on_evict(key, value)
        self._items.clear()
        self.used_bytes = 0


class HotPrefixes:
    """Chain-hash nodes a prefix hit landed on, each hot for `ttl` seconds after its latest hit (so a
    document nobody asks about any more decays back to writing nothing); at most `max_nodes`, the
    least recently hit forgotten first. After a restart the set is empty, but the store still holds
    the prefix's blocks and snapshots: its first hit makes it hot again and restores from them."""

    def __init__(self, ttl: float, max_nodes: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.ttl, self.max_nodes, self.clock = ttl, max_nodes, clock
        self._last_hit: OrderedDict[bytes, float] = OrderedDict()

    def mark(self, node: bytes) -> None:
        self._last_hit[node] = self.clock()
        self._last_hit.move_to_end(node)
        while len(self._last_hit) > self.max_nodes:
            self._last_hit.popitem(last=False)

    def any_hot(self, nodes: Iterable[bytes]) -> bool:
        now = self.clock()
        for node in nodes:
            last = self._last_hit.get(node)
            if last is not None and now - last < self.ttl:
                return True
        return False

    def count(self) -> int:
        """Nodes hot now (expired ones are dropped here)."""
        now = self.clock()
        while self._last_hit and now - next(iter(self._last_hit.values())) >= self.ttl:
            self._last_hit.popitem(last=False)
        return len(self._last_hit)

    def clear(self) -> None:
        self._last_hit.clear()


@dataclass(frozen=True)
class ResponseEnd:
    """A request's slot state where its response ended, inside a block: what resuming there needs
    besides the sealed blocks before it (the open block's entries, and the tokens it covers)."""

    parent: bytes  # the chain hash of the last sealed block before it (or the chain's root)
    tail: tuple[int, ...]  # tokens from that block boundary to where the response ended
    state: object  # the slot state (host tensors)
    block: bytes  # the open block's entries, every layer (as DeviceKV lays a block out)


class StateCache:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.slots = SlotAllocator(config.num_slots)
        # Sealed-boundary snapshots and end-of-response snapshots share one byte budget (LRU: a
        # conversation's newest turn end is its most recently used, so older ones go first).
        self.snapshots: HostSnapshots[object] = HostSnapshots(config.snapshot_bytes, self._forget_response)
        self._responses: dict[bytes, dict[tuple[int, ...], bytes]] = {}  # parent → {tail: key}
        self.hot = HotPrefixes(config.hot_seconds, config.max_hot_prefixes)

    # ---- restoring after a hit ----------------------------------------------------------------
    def restore_candidates(self, hit_blocks: int) -> Iterator[int]:
        """Block counts k, nearest first, whose boundary kB is a better restore point after a hit
        on `hit_blocks` blocks than rebuilding the state from nothing (if a snapshot exists)."""
        cfg = self.config
        floor = hit_blocks * cfg.block_size - cfg.zero_mode_span
        for k in range(hit_blocks, 0, -1):
            if k * cfg.block_size <= floor:
                return
            yield k

    def restore_point(self, hashes: Sequence[bytes], hit_blocks: int) -> tuple[int, bytes | None]:
        """(where computation resumes, the host snapshot restoring the slot there or None) after a
        hit on `hit_blocks` blocks."""
        for k in self.restore_candidates(hit_blocks):
            if hashes[k - 1] in self.snapshots:
                return k * self.config.block_size, hashes[k - 1]
        return max(0, hit_blocks * self.config.block_size - self.config.zero_mode_span), None

    # ---- taking snapshots ------------------------------------------------------------------------
    def is_snapshot_point(self, position: int, prompt_len: int, mode: str, hit_end: int = 0) -> bool:
        """Boundaries where a request writing in `mode` saves its slot state: every sealed boundary
        (`full`), or every interval and the prompt's last boundaries (`periodic`), plus `hit_end`,
        where a hot prefix was hit (`auto`, once hot)."""
        cfg, b = self.config, self.config.block_size
        if not cfg.enable_prefix_caching or mode == "zero" or position <= 0 or position % b:
            return False
        if mode == "full":
            return True
        ends = {(prompt_len // b) * b, ((prompt_len - 1) // b) * b, hit_end}
        return position % cfg.swa_checkpoint_interval == 0 or position in ends

    def next_snapshot_point(self, position: int, prompt_len: int, limit: int, mode: str,
                            hit_end: int = 0) -> int | None:
        """The first snapshot point in (position, limit], so a prefill chunk can end on it."""
        if mode == "zero":
            return None
        b = self.config.block_size
        for p in range((position // b + 1) * b, limit + 1, b):
            if self.is_snapshot_point(p, prompt_len, mode, hit_end):
                return p
        return None

    # ---- end-of-response snapshots ---------------------------------------------------------------
    def put_response(self, key: bytes, response: ResponseEnd, nbytes: int) -> None:
        if self.snapshots.put(key, response, nbytes):
            self._responses.setdefault(response.parent, {})[response.tail] = key

    def find_response(self, parent: bytes, following: Sequence[int]) -> bytes | None:
        """The end-of-response snapshot continuing `parent` with the longest tail that `following`
        (the tokens after that boundary) starts with."""
        best, found = 0, None
        for tail, key in self._responses.get(parent, {}).items():
            if best < len(tail) <= len(following) and tuple(following[:len(tail)]) == tail:
                best, found = len(tail), key
        return found

    def _forget_response(self, key: bytes, value: object) -> None:
        if isinstance(value, ResponseEnd):
            tails = self._responses.get(value.parent, {})
            tails.pop(value.tail, None)
            if not tails:
                self._responses.pop(value.parent, None)

    def check_integrity(self) -> None:
        self.slots.check_integrity()
