"""The KV manager: the one coordinator the engine talks to, in token counts and `RequestKV` handles.

It ties together three parts, each in its own module:
- the Block Cache's bookkeeping (`block_pool`: block ids, refcounts, the hash chain, LRU);
- the State Cache (`state_cache`: slots, host snapshots, and the restore policy after a hit);
- SSD-store loading (`ssd_loader`) and writing sealed blocks and snapshots to the store;
and moves bytes between them and the device tensors (`device_kv.DeviceKV`, behind the small
`DeviceAccess` interface so this module stays free of torch).

Prefix reuse. A new request's complete blocks are hashed; the longest chain of cached blocks
(capped so the last known token is always computed) gives H = h·B tokens whose compressed entries
need not be computed again; the State Cache's policy says where computation resumes (see
`state_cache`). A hit's blocks are taken with a reference; blocks the request computes are sealed
(made findable) as they fill, and written to the SSD store in the background.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from v4serve.cache.block_pool import (
    BlockPool,
    NoFreeBlocks,
    TokenSlice,
    block_hashes,
    chain_hash,
    extend_chain,
    root_hash,
)
from v4serve.cache.config import CacheConfig
from v4serve.cache.kv_events import DEVICE, KVEventLog
from v4serve.cache.kv_transfer import (
    ExpectedPrefix,
    FetchJob,
    FetchPool,
    FetchResult,
    KVSource,
    KVTransferConfig,
    fetch,
)
from v4serve.cache.request_kv import NO_HIT, PrefixPlan, RequestKV
from v4serve.cache.ssd_file import KIND_BLOCK, KIND_RESPONSE, KIND_SNAPSHOT
from v4serve.cache.ssd_loader import DiskLoad, PayloadCodec, SSDLoader
from v4serve.cache.ssd_store import SSDStore, StoreStats
from v4serve.cache.state_cache import ResponseEnd, StateCache


class DeviceAccess(PayloadCodec, Protocol):
    """What the bookkeeping needs from the device tensors: a slot's state out and in, and the bytes
    of blocks and snapshots for the SSD store."""

    def read_slot(self, slot: int) -> Any: ...
    def write_slot(self, slot: int, state: Any) -> None: ...
    def clear_slot(self, slot: int) -> None: ...
    def slot_nbytes(self) -> int: ...
    def block_payload(self, block_id: int) -> Sequence[memoryview]: ...
    def install_blocks(self, block_ids: list[int], stacked: list[Any]) -> None: ...
    def snapshot_payload(self, state: Any) -> list[memoryview]: ...


@dataclass(frozen=True)
class CacheStats:
    state_cache_usage: float  # fraction of slots in use
    block_cache_usage: float  # fraction of blocks referenced by requests
    evictions: int  # cached blocks evicted to make room, since start
    store: StoreStats | None  # the SSD store's counters (None when it is off)
    store_usage_bytes: int = 0
    store_quarantine_files: int = 0
    snapshot_bytes_host: int = 0  # window-state snapshots taken into host memory (not loads from disk)
    hot_prefixes: int = 0  # auto mode: prefix nodes hot now


class KVCacheManager:
    def __init__(self, config: CacheConfig, device: DeviceAccess, namespace: bytes,
                 store: SSDStore | None = None, events: KVEventLog | None = None) -> None:
        self.config = config
        self.device = device
        self.namespace = namespace
        self.store = store
        self.events = events  # KV events for routers (None: off)
        self.snapshot_bytes_host = 0
        self.pool = BlockPool(config.num_blocks)
        if events is not None:
            self.pool.on_forget = lambda h: events.removed(DEVICE, [h])
            if store is not None:
                store.events = events
        self.state = StateCache(config)
        self.loader = SSDLoader(store, self.state, device, config.block_size) if store is not None else None
        self._fetches: FetchPool | None = None  # a decode replica's hand-over fetches (made at the first)

    # ---- a request's handle --------------------------------------------------------------------
    def hashes(self, tokens: Sequence[int], cache_salt: str | None) -> list[bytes]:
        return block_hashes(root_hash(self.namespace, cache_salt), tokens, self.config.block_size)

    def new_request(self, cache_salt: str | None, num_tokens: int, tokens: TokenSlice,
                    swa_cache_mode: str | None = None) -> RequestKV:
        """A request's handle; `swa_cache_mode` its own way of writing window snapshots (None: the
        daemon's)."""
        mode = swa_cache_mode or self.config.swa_cache_mode
        kv = RequestKV(root=root_hash(self.namespace, cache_salt), swa_mode=mode)
        self.extend_hashes(kv, num_tokens, tokens)
        return kv

    def snapshot_mode(self, kv: RequestKV) -> str:
        """How the request writes snapshots now: its mode, `auto` resolved by its prefix's heat."""
        if kv.swa_mode != "auto":
            return kv.swa_mode
        return "periodic" if kv.hot else "zero"

    def _hit_end(self, kv: RequestKV) -> int:
        """auto: the boundary its hit landed on, saved too, so the next hit restores there."""
        return len(kv.plan.hit_blocks) * self.config.block_size if kv.swa_mode == "auto" else 0

    def extend_hashes(self, kv: RequestKV, num_tokens: int, tokens: TokenSlice) -> None:
        """Hash the blocks of known tokens completed since the last call."""
        extend_chain(kv.block_hashes, kv.root, tokens, num_tokens, self.config.block_size)

    # ---- admission -------------------------------------------------------------------------------
    def plan_prefix(self, kv: RequestKV, num_tokens: int, tokens: TokenSlice, reuse: bool = True,
                    admitting: bool = True) -> PrefixPlan:
        """The request's start: the cached blocks it can take and where computation resumes. Kept
        on the handle (its frozen/window bounds shape the first chunk). An end-of-response snapshot
        continuing the hit (a follow-up turn) resumes exactly where that response ended. Not
        `admitting` (a look at arrival), it leaves `auto`'s heat as it was: a hit counts once."""
        kv.plan = NO_HIT
        if not reuse or not self.config.enable_prefix_caching:
            return kv.plan
        hit = self.pool.longest_prefix(self._reusable(kv, num_tokens))
        hit_end = len(hit) * self.config.block_size
        # A tail stays inside the block after the hit, and the last known token is always computed.
        following_end = min(hit_end + self.config.block_size, num_tokens) - 1
        response = self._find_response(kv, len(hit), tokens(hit_end, following_end) if hit_end < following_end else [])
        if response is not None:
            key, tail = response
            kv.plan = PrefixPlan(tuple(hit), hit_end + tail, hit_end + tail, None, response_key=key)
        elif hit:
            resume, key = self.state.restore_point(kv.block_hashes, len(hit))
            kv.plan = PrefixPlan(tuple(hit), hit_end, resume, key)
        if kv.swa_mode == "auto" and admitting:
            if hit:
                self.state.hot.mark(kv.block_hashes[len(hit) - 1])
            kv.hot = kv.hot or bool(hit) or self.state.hot.any_hot(kv.block_hashes)
        return kv.plan

    def _find_response(self, kv: RequestKV, hit_blocks: int, following: Sequence[int]) -> tuple[bytes, int] | None:
        if not following:
            return None
        parent = kv.block_hashes[hit_blocks - 1] if hit_blocks else kv.root
        key = self.state.find_response(parent, following)
        if key is None:
            return None
        response = self.state.snapshots.get(key)
        assert isinstance(response, ResponseEnd)
        return key, len(response.tail)

    def chunk_size(self, kv: RequestKV, start: int, n: int, prompt_len: int, capture: bool = True) -> int:
        """The tokens of a chunk of at most n from `start`: all of them when the states at snapshot
        points inside it can be captured (`capture_points`), else up to the next snapshot point (the
        state there can then be saved)."""
        if capture and self.config.snapshots_inside_chunks:
            return n
        point = self.state.next_snapshot_point(self._first_point_after(kv, start), prompt_len, start + n - 1,
                                               self.snapshot_mode(kv), self._hit_end(kv))
        return n if point is None else point - start

    def capture_points(self, kv: RequestKV, start: int, end: int, prompt_len: int) -> tuple[int, ...]:
        """Snapshot points strictly inside a chunk [start, end) whose states the step must capture
        (the chunk's end is saved after the step as always)."""
        if not self.config.snapshots_inside_chunks:
            return ()
        mode, hit_end, b = self.snapshot_mode(kv), self._hit_end(kv), self.config.block_size
        first = (self._first_point_after(kv, start) // b + 1) * b
        # A state already saved there (a shared prefix, a resumed request) is not captured again.
        return tuple(p for p in range(first, end, b) if self.state.is_snapshot_point(p, prompt_len, mode, hit_end)
                     and kv.block_hashes[p // b - 1] not in self.state.snapshots)

    @staticmethod
    def _first_point_after(kv: RequestKV, start: int) -> int:
        """While a hit's window state is rebuilt, no point before the hit boundary counts."""
        return max(start, kv.frozen_until - 1) if kv.window_from else start

    def admit(self, kv: RequestKV, first_chunk_end: int) -> bool:
        """Take a slot, the planned hit's blocks and blocks for tokens up to first_chunk_end, and
        restore the slot's state per the plan; False (nothing taken) if slots or blocks are short."""
        plan = kv.plan
        need = self.config.blocks_needed(first_chunk_end, len(plan.hit_blocks))
        # Hit blocks sitting in the free queue leave it when taken: they cannot also be allocated.
        idle_hits = sum(1 for i in plan.hit_blocks if self.pool.blocks[i].ref_count == 0)
        if self.state.slots.num_free == 0 or need > self.pool.num_free - idle_hits:
            return False
        kv.slot = self.state.slots.allocate()
        assert kv.slot is not None
        self.pool.take(plan.hit_blocks)
        kv.block_table = list(plan.hit_blocks) + self.pool.allocate(need)
        kv.num_sealed = len(plan.hit_blocks)
        if plan.response_key is not None:  # the open block's entries into a fresh private block, then the state
            response = self.state.snapshots.get(plan.response_key)
            assert isinstance(response, ResponseEnd)
            open_block = kv.block_table[len(plan.hit_blocks)]
            self.device.install_blocks([open_block], self.device.stack_block_payloads([memoryview(response.block)]))
            self.device.write_slot(kv.slot, response.state)
        elif plan.snapshot_key is not None:
            state = self.state.snapshots.get(plan.snapshot_key)
            assert state is not None
            self.device.write_slot(kv.slot, state)
        else:
            self.device.clear_slot(kv.slot)
        return True

    def grow(self, kv: RequestKV, num_tokens: int) -> bool:
        """Extend the block table to cover num_tokens; False (nothing taken) if blocks are short."""
        if num_tokens <= len(kv.block_table) * self.config.block_size:
            return True  # most decode steps: the last block has room
        need = self.config.blocks_needed(num_tokens, len(kv.block_table))
        if need > self.pool.num_free:
            return False
        try:
            kv.block_table.extend(self.pool.allocate(need))
        except NoFreeBlocks:
            return False
        return True

    # ---- after a step -----------------------------------------------------------------------------
    def advance(self, kv: RequestKV, num_computed: int, prompt_len: int, tokens: TokenSlice,
                captured: Sequence[tuple[int, Any]] = ()) -> None:
        """The request has computed `num_computed` tokens: seal every block completed since the last
        call (and queue it for the SSD store), save the states `captured` at points inside the step's
        chunk (`capture_points`), and the slot state if `num_computed` is a snapshot point."""
        b = self.config.block_size
        if num_computed % b and num_computed // b <= kv.num_sealed and not captured:
            return  # inside a block (every decode step but one in 128): nothing sealed, no snapshot point
        full = min(num_computed // b, len(kv.block_hashes))
        for i in range(kv.num_sealed, full):
            parent = kv.block_hashes[i - 1] if i else None
            block_tokens = tokens(i * b, (i + 1) * b)
            if self.pool.seal(kv.block_table[i], kv.block_hashes[i], parent) and self.events is not None:
                self.events.stored(DEVICE, kv.block_hashes[i], parent, block_tokens)
            if self._store_writing():
                self.store.put(KIND_BLOCK, kv.block_hashes[i], block_tokens,
                               self.device.block_payload(kv.block_table[i]), parent)
        kv.num_sealed = max(kv.num_sealed, full)
        for point, state in captured:
            self._save_snapshot(kv, kv.block_hashes[point // b - 1], tokens(point - b, point), state)
        if kv.state_exact_at(num_computed) and self.state.is_snapshot_point(num_computed, prompt_len,
                                                                            self.snapshot_mode(kv), self._hit_end(kv)):
            self._save_snapshot(kv, kv.block_hashes[num_computed // b - 1], tokens(num_computed - b, num_computed))

    def save_response_end(self, kv: RequestKV, num_computed: int, tokens: TokenSlice) -> None:
        """A response has finished: keep the slot at its exact last computed position, with its open
        block's entries, so the next turn of the conversation resumes right there (all modes that
        snapshot; never for an aborted or failed request, whose state may be half made)."""
        cfg, b = self.config, self.config.block_size
        if (not cfg.enable_prefix_caching or self.snapshot_mode(kv) == "zero" or kv.slot is None or not num_computed
                or not kv.state_exact_at(num_computed)):
            return
        sealed = num_computed // b
        if num_computed % b == 0:  # at a block boundary it is an ordinary sealed snapshot
            self._save_snapshot(kv, kv.block_hashes[sealed - 1], tokens(num_computed - b, num_computed))
            return
        parent = kv.block_hashes[sealed - 1] if sealed else kv.root
        tail = tuple(tokens(sealed * b, num_computed))
        key = chain_hash(parent, tail)
        if key in self.state.snapshots:
            return
        block = b"".join(self.device.block_payload(kv.block_table[sealed]))
        response = ResponseEnd(parent, tail, self.device.read_slot(kv.slot), block)
        self.state.put_response(key, response, self.device.slot_nbytes() + len(block))
        self.snapshot_bytes_host += self.device.slot_nbytes() + len(block)
        if self._store_writing():  # so the conversation resumes here after a restart too
            self.store.put(KIND_RESPONSE, key, tail, [*self.device.snapshot_payload(response.state), block], parent)

    def _save_snapshot(self, kv: RequestKV, key: bytes, last_block_tokens: Sequence[int], state: Any = None) -> None:
        """The slot's state now (or `state`, captured at that boundary inside a chunk) under `key`."""
        if key in self.state.snapshots:
            return
        assert kv.slot is not None
        if state is None:
            state = self.device.read_slot(kv.slot)
        if self.state.snapshots.put(key, state, self.device.slot_nbytes()):
            self.snapshot_bytes_host += self.device.slot_nbytes()
        if self._store_writing():
            self.store.put(KIND_SNAPSHOT, key, last_block_tokens, self.device.snapshot_payload(state))

    # ---- prefill and decode apart (cache/kv_transfer.py) ---------------------------------------------
    def hand_over(self, kv: RequestKV, transfer_id: str, num_computed: int, tokens: TokenSlice,
                  hold_seconds: float) -> bool:
        """A prefill replica's side: the prefix [0, num_computed) — its sealed blocks and the slot's state
        at `num_computed` (the prompt's last token not computed yet, as a decode replica's hit resumes) —
        written to the store and linked for a decode replica to fetch, whatever the request's window
        snapshot mode. False if there is no store or the state there is not exact."""
        store = self.store
        if store is None or kv.slot is None or not kv.state_exact_at(num_computed):
            return False
        b = self.config.block_size
        sealed = num_computed // b
        entries = []
        for i in range(sealed):
            h = kv.block_hashes[i]
            if not store.has(KIND_BLOCK, h):  # its write was dropped, or it was evicted since
                store.put(KIND_BLOCK, h, tokens(i * b, (i + 1) * b), self.device.block_payload(kv.block_table[i]),
                          kv.block_hashes[i - 1] if i else None)
            entries.append((KIND_BLOCK, h))
        if num_computed:
            if num_computed % b == 0:
                key = kv.block_hashes[sealed - 1]
                if not store.has(KIND_SNAPSHOT, key):
                    store.put(KIND_SNAPSHOT, key, tokens(num_computed - b, num_computed),
                              self.device.snapshot_payload(self.device.read_slot(kv.slot)))
                entries.append((KIND_SNAPSHOT, key))
            else:
                parent = kv.block_hashes[sealed - 1] if sealed else kv.root
                tail = tuple(tokens(sealed * b, num_computed))
                key = chain_hash(parent, tail)
                block = b"".join(self.device.block_payload(kv.block_table[sealed]))
                state = self.device.snapshot_payload(self.device.read_slot(kv.slot))
                store.put(KIND_RESPONSE, key, tail, [*state, block], parent)
                entries.append((KIND_RESPONSE, key))
        return store.hand_over(transfer_id, entries, hold_seconds)

    def start_fetch(self, kv: RequestKV, source: KVSource, tokens: TokenSlice, num_prompt_tokens: int,
                    transfer: KVTransferConfig) -> bool:
        """A decode replica's side: fetch a prefill replica's hand-over into the store on a fetch thread
        (at most `max_fetches` at once), checked against what this request's own prompt implies; the
        request waits meanwhile, and its prefix then comes from the store as any disk hit does. The
        fetch ends `fetch_timeout` from now, whatever the peer does. False without a store."""
        store = self.store
        if store is None:
            return False
        if self._fetches is None:
            self._fetches = FetchPool(transfer.max_fetches)
        expected = ExpectedPrefix.of(kv.root, kv.block_hashes, tokens(0, num_prompt_tokens), self.config.block_size)
        deadline = time.monotonic() + transfer.fetch_timeout
        kv.fetch = self._fetches.submit(lambda job: fetch(store, source, expected, transfer, deadline, job))
        return True

    def finish_fetch(self, kv: RequestKV) -> FetchResult:
        assert kv.fetch is not None and kv.fetch.done()
        future, kv.fetch = kv.fetch, None
        return future.result()

    def _store_writing(self) -> bool:
        return self.store is not None and self.store.writing

    # ---- the SSD store ------------------------------------------------------------------------------
    @property
    def reads_from_store(self) -> bool:
        """Whether a prefix can come from the SSD store (a store, and prefix caching on)."""
        return self.loader is not None and self.config.enable_prefix_caching

    def start_disk_load(self, kv: RequestKV, num_tokens: int, tokens: TokenSlice, admitting: bool = True) -> bool:
        """If the store holds blocks past the planned device hit, start reading them in the background
        (the request waits meanwhile); False if there is nothing to read. Asked at a request's arrival
        and, if nothing was there then, once more as it is admitted: a request that came while its
        prefix was still being written (a burst of questions about one new document) finds it on disk
        by then, where the Block Cache may have let it go."""
        if not self.reads_from_store or kv.disk_checked:
            return False
        b, first = self.config.block_size, len(kv.plan.hit_blocks)
        count = self.loader.blocks_on_disk(self._reusable(kv, num_tokens)[first:])
        boundary = first + count
        following_end = min(boundary * b + b, num_tokens) - 1  # as in plan_prefix
        # With blocks to read, the load looks for a response end itself, beside them: not first here.
        if not count and not self._response_on_disk(kv, boundary, following_end, tokens):
            kv.disk_checked = admitting
            return False
        kv.disk_checked = True
        kv.disk_load = self.loader.start(kv.block_hashes, tokens(0, max(following_end, boundary * b)), first, count,
                                         kv.root)
        return True

    def _response_on_disk(self, kv: RequestKV, boundary: int, following_end: int, tokens: TokenSlice) -> bool:
        """Whether the store holds a response end continuing the request's sealed prefix at `boundary`
        (no blocks to read past its device hit) that goes further than the one planned from host memory
        (a decode replica's hand-over continues past what an earlier, shorter response left there)."""
        b = self.config.block_size
        if boundary * b >= following_end:
            return False
        planned = kv.plan.hit_tokens - boundary * b if kv.plan.response_key is not None else 0
        parent = kv.block_hashes[boundary - 1] if boundary else kv.root
        return self.loader.response_on_disk(parent, tokens(boundary * b, following_end), longer_than=planned)

    def finish_disk_load(self, kv: RequestKV) -> DiskLoad:
        """Install a finished read (raises what the read raised); returns it, its phases complete."""
        assert kv.disk_load is not None and kv.disk_load.done()
        future, kv.disk_load = kv.disk_load, None
        load: DiskLoad = future.result()
        t0 = time.perf_counter()
        kv.disk_tokens = self._install(load, kv.block_hashes) * self.config.block_size
        load.phases["wait"] = t0 - load.done_at  # done on its thread, not yet taken up by the engine's
        load.phases["install"] = time.perf_counter() - t0
        return load

    def _install(self, load: DiskLoad, hashes: Sequence[bytes]) -> int:
        """Copy loaded blocks into free device blocks and make them findable (refcount 0, like any
        cached block); returns how many were installed. The request's device-hit blocks are held
        meanwhile so that making room cannot evict them."""
        device_hit = self.pool.longest_prefix(hashes[: load.first])
        self.pool.take(device_hit)
        try:
            n = min(len(load.hashes), self.pool.num_free)
            ids = self.pool.allocate(n)
            if n:
                self.device.install_blocks(ids, load.stacked)
            for j, (block_id, h) in enumerate(zip(ids, load.hashes, strict=False)):
                parent = hashes[load.first + j - 1] if load.first + j else None
                if self.pool.seal(block_id, h, parent) and self.events is not None:
                    self.events.stored(DEVICE, h, parent, load.tokens[j])
            self.pool.release(reversed(ids))
        finally:
            self.pool.release(reversed(device_hit))
        if load.snapshot is not None:
            key, state = load.snapshot
            self.state.snapshots.put(key, state, self.device.slot_nbytes())
        if load.response is not None:
            key, response = load.response
            self.state.put_response(key, response, self.device.slot_nbytes() + len(response.block))
        return n

    def _reusable(self, kv: RequestKV, num_tokens: int) -> list[bytes]:
        return kv.block_hashes[: self.config.reusable_blocks(num_tokens)]

    # ---- release ------------------------------------------------------------------------------------
    def free(self, kv: RequestKV) -> None:
        """Give back the slot and every block reference at once (finish, abort or preemption); a hand-over
        fetch still queued or running is abandoned (its thread is free again at once)."""
        if isinstance(kv.fetch, FetchJob):
            kv.fetch.abandon()
            kv.fetch = None
        if kv.slot is not None:
            self.state.slots.free(kv.slot)
            kv.slot = None
        self.pool.release(reversed(kv.block_table))
        kv.block_table = []
        kv.num_sealed = 0
        kv.plan = NO_HIT

    def reset_prefix_cache(self, store: bool = False) -> tuple[int, int]:
        """Forget every cached block no request holds, every host snapshot and which prefixes are hot;
        with `store`, also remove every file of this namespace from the SSD store. → (blocks dropped,
        files removed)
        Writes already queued for the store land first: the next request's hit comes from disk, and a
        write cannot bring back a file the clearing removed."""
        self.state.snapshots.clear()
        self.state.hot.clear()
        if self.store is not None:
            self.store.flush()
        removed = self.store.clear() if store and self.store is not None else 0
        dropped = self.pool.reset()
        on_disk = self.store is not None and self.store.used_bytes > 0
        if self.events is not None and not on_disk and not any(b.block_hash for b in self.pool.blocks):
            self.events.cleared()  # nothing findable is left in any tier
        return dropped, removed

    def stats(self) -> CacheStats:
        store, hot = self.store, self.state.hot.count()
        if store is None:
            return CacheStats(self.state.slots.usage(), self.pool.usage(), self.pool.evictions, None,
                              snapshot_bytes_host=self.snapshot_bytes_host, hot_prefixes=hot)
        return CacheStats(self.state.slots.usage(), self.pool.usage(), self.pool.evictions, store.stats_snapshot(),
                          store.used_bytes, store.quarantined, self.snapshot_bytes_host, hot)

    def check_integrity(self, admitted: Iterable[RequestKV] | None = None) -> None:
        """The pool's and slots' invariants; given every admitted request, refcounts are checked
        against their block tables too."""
        self.pool.check_integrity(None if admitted is None else [kv.block_table for kv in admitted])
        self.state.check_integrity()
