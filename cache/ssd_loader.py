"""Loading a waiting request's prefix from the SSD store, off the engine thread.

When the store holds blocks past a request's device hit, the request waits (LOADING) while a
reader thread reads those block files (runs of them in parallel) and, alongside, the best
snapshot to restore the window state from, then stacks the blocks into one host buffer per
storage tensor. The engine thread later installs the result with one copy per tensor
(`KVCacheManager.finish_disk_load`). A bad or vanished file ends the prefix there: a miss.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from v4serve.cache.ssd_file import KIND_BLOCK, KIND_SNAPSHOT
from v4serve.cache.ssd_store import SSDStore, in_daemon_thread
from v4serve.cache.state_cache import StateCache


class PayloadCodec(Protocol):
    """What loading needs from the device tensors: bytes in, host tensors out."""

    def stack_block_payloads(self, payloads: list[memoryview]) -> list[Any]: ...
    def snapshot_from_payload(self, payload: memoryview) -> Any: ...


@dataclass
class DiskLoad:
    """Blocks (and at most one snapshot) read from the SSD store for one waiting request."""

    first: int  # index of the first block loaded
    hashes: list[bytes] = field(default_factory=list)  # of the blocks loaded, in order
    stacked: list[Any] = field(default_factory=list)  # their contents, one host tensor per storage tensor
    snapshot: tuple[bytes, Any] | None = None  # (key, host state)
    seconds: float = 0.0


class SSDLoader:
    def __init__(self, store: SSDStore, state: StateCache, codec: PayloadCodec, block_size: int) -> None:
        self.store, self.state, self.codec, self.block_size = store, state, codec, block_size

    def blocks_on_disk(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, the store holds."""
        return self.store.longest_prefix(hashes)

    def start(self, hashes: Sequence[bytes], tokens: Sequence[int], first: int, count: int) -> Future:
        """Read blocks [first, first+count) and the best snapshot on a reader thread → DiskLoad."""
        hashes, tokens = list(hashes), list(tokens)
        return self.store.submit(lambda: self._read(hashes, tokens, first, count))

    def _read(self, hashes: list[bytes], tokens: list[int], first: int, count: int) -> DiskLoad:
        t0, b = time.perf_counter(), self.block_size
        load = DiskLoad(first=first)
        items = [(hashes[i], tokens[i * b:(i + 1) * b]) for i in range(first, first + count)]
        # The snapshot at the end of the run is read alongside the blocks; if a bad block cuts the
        # run short, a nearer one is looked for afterwards.
        snapshot = in_daemon_thread(lambda: self._read_snapshot(hashes, tokens, first + count))
        payloads = self.store.get_many(KIND_BLOCK, items)
        load.hashes = [h for h, _ in items[: len(payloads)]]
        load.stacked = self.codec.stack_block_payloads(payloads) if payloads else []
        load.snapshot = snapshot.result()
        if len(payloads) < count:
            load.snapshot = self._read_snapshot(hashes, tokens, first + len(payloads))
        load.seconds = time.perf_counter() - t0
        return load

    def _read_snapshot(self, hashes: list[bytes], tokens: list[int], top: int) -> tuple[bytes, Any] | None:
        """The nearest snapshot on disk below block `top` that beats a zero-mode recompute, unless
        host memory already holds a nearer one (then the plan takes that)."""
        b = self.block_size
        for k in self.state.restore_candidates(top):
            key = hashes[k - 1]
            if key in self.state.snapshots:
                return None
            if self.store.contains(KIND_SNAPSHOT, key):
                payload = self.store.read(KIND_SNAPSHOT, key, tokens[(k - 1) * b:k * b])
                if payload is not None:
                    return key, self.codec.snapshot_from_payload(payload)
        return None
