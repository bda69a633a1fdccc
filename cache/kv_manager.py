"""The KV manager: one facade over the State Cache (slots), the Block Cache (pool + storage) and
the host snapshot store, speaking in token counts and block tables.

Prefix reuse. A new request's complete prompt blocks are hashed; the longest chain of cached
blocks (capped so the last prompt token is always computed) gives H = h·B tokens whose
compressed entries need not be computed again. The next token also needs every layer's window
and compressor tail at H, restored from the cheapest valid point p ≤ H:
- a snapshot of the slot state at a sealed boundary kB (modes `full` and `periodic`), or
- p = H − (window−1)·L from an empty state (any mode; the only one in `zero`): recomputing
  [p, H) while attention reads the cached entries is exact for layer ℓ from position
  p + (window−1)(ℓ+1) on, so every layer's state at H is exact.
Tokens [p, H) are recomputed with their entries frozen (cached blocks are never written).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

from v4serve.cache.block_pool import BlockPool, NoFreeBlocks, block_hashes, chain_hash, root_hash
from v4serve.cache.slots import SlotAllocator
from v4serve.cache.snapshots import SnapshotStore
from v4serve.cache.ssd_store import KIND_BLOCK, KIND_SNAPSHOT, KVStore

SWA_CACHE_MODES = ("full", "periodic", "zero")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    window: int
    num_layers: int
    num_slots: int
    num_blocks: int
    swa_cache_mode: str = "periodic"
    swa_checkpoint_interval: int = 4096
    enable_prefix_caching: bool = True
    snapshot_bytes: int = 1 << 30
    # Widest compressor overlap (CSA ratio): its tail rows must also be exact after a zero-mode
    # recompute, so the recompute span covers at least that many tokens per layer.
    overlap_ratio: int = 0

    def __post_init__(self) -> None:
        if self.swa_cache_mode not in SWA_CACHE_MODES:
            raise ValueError(f"swa_cache_mode must be one of {SWA_CACHE_MODES}, got {self.swa_cache_mode!r}")
        if self.swa_checkpoint_interval <= 0 or self.swa_checkpoint_interval % self.block_size:
            raise ValueError(f"swa_checkpoint_interval must be a positive multiple of the block size "
                             f"({self.block_size}), got {self.swa_checkpoint_interval}")

    @property
    def zero_mode_span(self) -> int:
        """Tokens recomputed before a hit boundary to rebuild the state from nothing."""
        return max(self.window - 1, self.overlap_ratio) * self.num_layers


@dataclass(frozen=True)
class PrefixPlan:
    hit_blocks: list[int]  # cached block ids to take, in order
    hit_tokens: int  # H: tokens whose compressed entries come from the cache
    resume_from: int  # where computation resumes
    snapshot_key: bytes | None  # snapshot restoring the slot at `resume_from`, if any

    @property
    def recompute_tokens(self) -> int:
        return self.hit_tokens - self.resume_from

    @property
    def window_from(self) -> int:
        """Window KV below this position is absent (zero-mode recompute starts empty)."""
        return 0 if self.snapshot_key is not None else self.resume_from


NO_HIT = PrefixPlan(hit_blocks=[], hit_tokens=0, resume_from=0, snapshot_key=None)


class StateStorage:
    """What the manager needs from the torch storage: slot state out and in, block and snapshot
    bytes for the SSD store."""

    def read_slot(self, slot: int) -> Any: ...
    def write_slot(self, slot: int, state: Any) -> None: ...
    def slot_nbytes(self) -> int: ...
    def clear_slot(self, slot: int) -> None: ...
    def block_payload(self, block_id: int) -> list[memoryview]: ...
    def stack_block_payloads(self, payloads: list[memoryview]) -> list[Any]: ...
    def install_blocks(self, block_ids: list[int], stacked: list[Any]) -> None: ...
    def snapshot_payload(self, state: Any) -> list[memoryview]: ...
    def snapshot_from_payload(self, payload: memoryview) -> Any: ...


@dataclass
class DiskLoad:
    """Blocks (and at most one snapshot) read from the SSD store for one waiting request."""

    first: int  # index of the first block loaded
    hashes: list[bytes] = field(default_factory=list)  # of the blocks loaded, in order
    stacked: list[Any] = field(default_factory=list)  # their contents, one host tensor per storage tensor
    snapshot: tuple[bytes, Any] | None = None  # (key, host state)
    seconds: float = 0.0


class KVCacheManager:
    def __init__(self, config: CacheConfig, storage: StateStorage, namespace: bytes,
                 store: KVStore | None = None) -> None:
        self.config = config
        self.storage = storage
        self.namespace = namespace
        self.store = store
        self.pool = BlockPool(config.num_blocks)
        self.slots = SlotAllocator(config.num_slots)
        self.snapshots: SnapshotStore[Any] = SnapshotStore(config.snapshot_bytes)

    # ---- hashing -------------------------------------------------------------------------
    def root(self, cache_salt: str | None) -> bytes:
        return root_hash(self.namespace, cache_salt)

    def hashes(self, tokens: Sequence[int], cache_salt: str | None) -> list[bytes]:
        return block_hashes(self.root(cache_salt), tokens, self.config.block_size)

    def extend_hashes(self, hashes: list[bytes], tokens: Sequence[int], cache_salt: str | None) -> None:
        """Append the hashes of blocks of `tokens` completed since `hashes` was last extended."""
        b = self.config.block_size
        parent = hashes[-1] if hashes else self.root(cache_salt)
        for i in range(len(hashes), len(tokens) // b):
            parent = chain_hash(parent, tokens[i * b:(i + 1) * b])
            hashes.append(parent)

    # ---- prefix reuse ----------------------------------------------------------------------
    def plan_prefix(self, prompt_hashes: Sequence[bytes], prompt_len: int) -> PrefixPlan:
        if not self.config.enable_prefix_caching or prompt_len <= 1:
            return NO_HIT
        b = self.config.block_size
        usable = list(prompt_hashes[: (prompt_len - 1) // b])
        hit = self.pool.longest_prefix(usable)
        if not hit:
            return NO_HIT
        h_tokens = len(hit) * b
        resume, key = max(0, h_tokens - self.config.zero_mode_span), None
        if self.config.swa_cache_mode != "zero":
            for k in range(len(hit), 0, -1):
                if k * b <= resume:
                    break
                if prompt_hashes[k - 1] in self.snapshots:
                    resume, key = k * b, prompt_hashes[k - 1]
                    break
        return PrefixPlan(hit_blocks=hit, hit_tokens=h_tokens, resume_from=resume, snapshot_key=key)

    def blocks_needed(self, num_tokens: int, table_len: int) -> int:
        return max(0, -(-num_tokens // self.config.block_size) - table_len)

    def admit(self, plan: PrefixPlan, first_chunk_end: int) -> tuple[int, list[int]] | None:
        """Take a slot and the blocks to hold tokens [0, first_chunk_end); restore the slot's
        state per the plan. None (and nothing taken) if either is short."""
        need = self.blocks_needed(first_chunk_end, len(plan.hit_blocks))
        if self.slots.num_free == 0 or need > self.pool.num_free - self._evictable_hits(plan):
            return None
        slot = self.slots.allocate()
        assert slot is not None
        self.pool.take(plan.hit_blocks)
        table = list(plan.hit_blocks) + self.pool.allocate(need)
        if plan.snapshot_key is not None:
            state = self.snapshots.get(plan.snapshot_key)
            assert state is not None
            self.storage.write_slot(slot, state)
        else:
            self.storage.clear_slot(slot)
        return slot, table

    def _evictable_hits(self, plan: PrefixPlan) -> int:
        # Hit blocks sitting in the free queue leave it when taken: they cannot also be allocated.
        return sum(1 for i in plan.hit_blocks if self.pool.blocks[i].ref_count == 0)

    def grow(self, table: list[int], num_tokens: int) -> bool:
        """Extend a block table to cover num_tokens; False (nothing taken) if blocks are short."""
        need = self.blocks_needed(num_tokens, len(table))
        if need > self.pool.num_free:
            return False
        try:
            table.extend(self.pool.allocate(need))
        except NoFreeBlocks:
            return False
        return True

    def seal(self, table: Sequence[int], hashes: Sequence[bytes], num_sealed: int, num_computed: int,
             tokens: Sequence[int], tokens_from: int = 0) -> int:
        """Seal every block fully computed since the last call (and queue it for the SSD store);
        `tokens` holds the sequence's tokens from position `tokens_from` on. Returns the new
        sealed count."""
        b = self.config.block_size
        full = min(num_computed // b, len(hashes))
        for i in range(num_sealed, full):
            self.pool.seal(table[i], hashes[i])
            if self.store is not None and self.store.writing:
                block_tokens = tokens[i * b - tokens_from:(i + 1) * b - tokens_from]
                self.store.put(KIND_BLOCK, hashes[i], block_tokens, self.storage.block_payload(table[i]))
        return max(num_sealed, full)

    # ---- snapshots -------------------------------------------------------------------------
    def is_snapshot_point(self, position: int, prompt_len: int) -> bool:
        """Boundaries where the slot state is saved: every sealed boundary (`full`), or every
        interval and the prompt's last boundaries (`periodic`)."""
        cfg, b = self.config, self.config.block_size
        if not cfg.enable_prefix_caching or cfg.swa_cache_mode == "zero" or position <= 0 or position % b:
            return False
        if cfg.swa_cache_mode == "full":
            return True
        ends = {(prompt_len // b) * b, ((prompt_len - 1) // b) * b}
        return position % cfg.swa_checkpoint_interval == 0 or position in ends

    def next_snapshot_point(self, position: int, prompt_len: int, limit: int) -> int | None:
        """The first snapshot point in (position, limit], so a prefill chunk can end on it."""
        b = self.config.block_size
        for p in range((position // b + 1) * b, limit + 1, b):
            if self.is_snapshot_point(p, prompt_len):
                return p
        return None

    def save_snapshot(self, slot: int, key: bytes, last_block_tokens: Sequence[int]) -> None:
        if key in self.snapshots:
            return
        state = self.storage.read_slot(slot)
        self.snapshots.put(key, state, self.storage.slot_nbytes())
        if self.store is not None and self.store.writing:
            self.store.put(KIND_SNAPSHOT, key, last_block_tokens, self.storage.snapshot_payload(state))

    # ---- the SSD store ---------------------------------------------------------------------------
    def disk_blocks(self, hashes: Sequence[bytes], prompt_len: int, device_hit: int) -> int:
        """How many blocks after the device hit the SSD store holds (same cap as plan_prefix)."""
        if self.store is None or not self.config.enable_prefix_caching:
            return 0
        usable = hashes[: (prompt_len - 1) // self.config.block_size]
        return self.store.longest_prefix(usable[device_hit:])

    def start_load(self, hashes: Sequence[bytes], tokens: Sequence[int], first: int, count: int) -> Future:
        """Read blocks [first, first+count) and the best snapshot on a reader thread."""
        assert self.store is not None
        return self.store.submit(lambda: self._load(list(hashes), list(tokens), first, count))

    def _load(self, hashes: list[bytes], tokens: list[int], first: int, count: int) -> DiskLoad:
        assert self.store is not None
        t0, b = time.perf_counter(), self.config.block_size
        load = DiskLoad(first=first)
        items = [(hashes[i], tokens[i * b:(i + 1) * b]) for i in range(first, first + count)]
        # The snapshot at the end of the run is read alongside the blocks; if a bad block cuts the
        # run short, a nearer one is looked for afterwards.
        snapshot = None
        if self.config.swa_cache_mode != "zero":
            snapshot = self.store.submit_io(lambda: self._load_snapshot(hashes, tokens, first + count))
        payloads = self.store.get_many(KIND_BLOCK, items)  # a bad or vanished file ends the prefix
        load.hashes = [h for h, _ in items[: len(payloads)]]
        load.stacked = self.storage.stack_block_payloads(payloads) if payloads else []
        if snapshot is not None:
            load.snapshot = snapshot.result()
            if len(payloads) < count:
                load.snapshot = self._load_snapshot(hashes, tokens, first + len(payloads))
        load.seconds = time.perf_counter() - t0
        return load

    def _load_snapshot(self, hashes: list[bytes], tokens: list[int], top: int) -> tuple[bytes, Any] | None:
        assert self.store is not None
        b, floor = self.config.block_size, top * self.config.block_size - self.config.zero_mode_span
        for k in range(top, 0, -1):
            if k * b <= floor:
                return None  # a zero-mode recompute is already as cheap
            key = hashes[k - 1]
            if key in self.snapshots:
                return None
            if self.store.contains(KIND_SNAPSHOT, key):
                payload = self.store.get(KIND_SNAPSHOT, key, tokens[(k - 1) * b:k * b])
                if payload is not None:
                    return key, self.storage.snapshot_from_payload(payload)
        return None

    def install(self, load: DiskLoad, hashes: Sequence[bytes]) -> int:
        """Copy loaded blocks into free device blocks and make them findable (refcount 0, like
        any cached block); returns how many were installed. The request's device-hit blocks are
        held meanwhile so that making room cannot evict them."""
        device_hit = self.pool.longest_prefix(hashes[: load.first])
        self.pool.take(device_hit)
        try:
            n = min(len(load.hashes), self.pool.num_free)
            ids = self.pool.allocate(n)
            if n:
                self.storage.install_blocks(ids, load.stacked)
            for block_id, h in zip(ids, load.hashes, strict=False):
                self.pool.seal(block_id, h)
            self.pool.release(reversed(ids))
        finally:
            self.pool.release(reversed(list(device_hit)))
        if load.snapshot is not None:
            key, state = load.snapshot
            self.snapshots.put(key, state, self.storage.slot_nbytes())
        return n

    # ---- release ----------------------------------------------------------------------------
    def free(self, slot: int | None, table: list[int]) -> None:
        if slot is not None:
            self.slots.free(slot)
        self.pool.release(reversed(table))
        table.clear()

    def reset_prefix_cache(self, store: bool = False) -> int:
        self.snapshots.clear()
        if store and self.store is not None:
            self.store.clear()
        return self.pool.reset()

    def check_integrity(self, tables: Sequence[Sequence[int]] | None = None) -> None:
        self.pool.check_integrity(tables)
        self.slots.check_integrity()
