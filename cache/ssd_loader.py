"""Loading a waiting request's prefix from the SSD store, off the engine thread.

When the store holds blocks past a request's device hit, or the end of an earlier response that the
request continues, the request waits (LOADING) while a loader thread has those block files read by
the store's reader process (`SSDStore.get_many`: every file handed to the kernel to read before the
first is read, then read in order), and alongside, on a thread of this process, the best snapshot to
restore the window state from and the response end. Each block's payload is read into shared memory
and copied once, after its checks, into its row of one host buffer (pinned on a GPU; on a CPU one kept
from load to load, `device_kv.HostRows`), whose views are the host tensors: no copy between that and
the install, which the engine thread later does with one copy per storage tensor
(`KVCacheManager.finish_disk_load`). A bad or vanished file ends the prefix there: a miss.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from v4serve.cache.block_pool import chain_hash
from v4serve.cache.ssd_file import KIND_BLOCK, KIND_RESPONSE, KIND_SNAPSHOT
from v4serve.cache.ssd_store import SSDStore, in_daemon_thread
from v4serve.cache.state_cache import ResponseEnd, StateCache


class PayloadCodec(Protocol):
    """What loading needs from the device tensors: bytes in, host tensors out."""

    def block_rows(self, n: int) -> tuple[Any, Sequence[memoryview]]: ...
    def blocks_from_rows(self, rows: Any, n: int) -> list[Any]: ...
    def snapshot_from_payload(self, payload: memoryview) -> Any: ...
    def slot_nbytes(self) -> int: ...


@dataclass
class DiskLoad:
    """Blocks (and at most one snapshot) read from the SSD store for one waiting request."""

    first: int  # index of the first block loaded
    hashes: list[bytes] = field(default_factory=list)  # of the blocks loaded, in order
    tokens: list[Sequence[int]] = field(default_factory=list)  # their token ids
    stacked: list[Any] = field(default_factory=list)  # their contents, one host tensor per storage tensor
    snapshot: tuple[bytes, Any] | None = None  # (key, host state)
    response: tuple[bytes, ResponseEnd] | None = None  # (key, the end of a response the request continues)
    seconds: float = 0.0
    # Where the load's time went (LOAD_PHASES): waiting for a reader thread, reading files and checking
    # them (the snapshot's on a thread beside the blocks': their seconds add up), allocating the host
    # buffer the blocks are read into ("stack"); the engine thread adds installing them and the wait
    # before it did.
    phases: Counter = field(default_factory=Counter)
    done_at: float = 0.0  # perf_counter when the reader finished


LOAD_PHASES = ("queue", "read", "verify", "stack", "wait", "install")



class SSDLoader:
    def __init__(self, store: SSDStore, state: StateCache, codec: PayloadCodec, block_size: int) -> None:
        self.store, self.state, self.codec, self.block_size = store, state, codec, block_size

    def blocks_on_disk(self, hashes: Sequence[bytes]) -> int:
        """How many of `hashes`, from the first, the store holds."""
        return self.store.longest_prefix(hashes)

    def response_on_disk(self, parent: bytes, following: Sequence[int], longer_than: int = 0) -> bool:
        """Whether the store holds (and host memory does not) a response end continuing `parent`
        that `following` (the tokens after that boundary) goes on from, with a tail of more than
        `longer_than` tokens."""
        match = self._matching_response(parent, following)
        return match is not None and match[1] > longer_than and match[0] not in self.state.snapshots

    def _matching_response(self, parent: bytes, following: Sequence[int]) -> tuple[bytes, int] | None:
        """The store's response end with the longest tail that `following` starts with."""
        best = None
        for key, tail_len in self.store.responses(parent).items():
            if (best is None or tail_len > best[1]) and tail_len <= len(following) \
                    and chain_hash(parent, following[:tail_len]) == key:
                best = (key, tail_len)
        return best

    def start(self, hashes: Sequence[bytes], tokens: Sequence[int], first: int, count: int,
              root: bytes | None) -> Future:
        """Read blocks [first, first+count), the best snapshot and, given the chain's `root`, the
        response end the request continues (if any) on a reader thread → DiskLoad."""
        hashes, tokens = list(hashes), list(tokens)
        submitted = time.perf_counter()
        return self.store.submit(lambda: self._read(hashes, tokens, first, count, root, submitted))

    def _read(self, hashes: list[bytes], tokens: list[int], first: int, count: int, root: bytes | None,
              submitted: float) -> DiskLoad:
        t0, b = time.perf_counter(), self.block_size
        load = DiskLoad(first=first)
        load.phases["queue"] = t0 - submitted
        items = [(hashes[i], tokens[i * b:(i + 1) * b]) for i in range(first, first + count)]
        # The snapshot and response end at the end of the run are read alongside the blocks, from the
        # moment the blocks are asked for (started before, their reads took the interpreter from the
        # making of that request: ~3 ms of a 64K-token hit); if a bad block cuts the run short, the
        # ones for where it ends are looked for afterwards.
        beside: Counter = Counter()
        ends: list[Future] = []

        def read_ends() -> None:
            ends.append(in_daemon_thread(lambda: self._read_ends(hashes, tokens, first + count, root, beside)))

        t_stack = time.perf_counter()
        rows, views = self.codec.block_rows(count)
        load.phases["stack"] = time.perf_counter() - t_stack
        payloads = self.store.get_many(KIND_BLOCK, items, load.phases, into=views, asked=read_ends)
        if not ends:  # no file was asked for
            read_ends()
        load.hashes = [h for h, _ in items[: len(payloads)]]
        load.tokens = [t for _, t in items[: len(payloads)]]  # copied only if told to KV events (`stored`)
        load.stacked = self.codec.blocks_from_rows(rows, len(payloads)) if payloads else []
        load.snapshot, load.response = ends[0].result()
        load.phases.update(beside)
        if len(payloads) < count:
            load.snapshot, load.response = self._read_ends(hashes, tokens, first + len(payloads), root, load.phases)
        load.done_at = time.perf_counter()
        load.seconds = load.done_at - t0
        return load

    def _read_ends(self, hashes: list[bytes], tokens: list[int], boundary: int, root: bytes | None,
                   timings: Counter) -> tuple[tuple[bytes, Any] | None, tuple[bytes, ResponseEnd] | None]:
        """The best snapshot below block `boundary` and, given the chain's `root`, the end of an earlier
        response that the request continues from there."""
        snapshot = self._read_snapshot(hashes, tokens, boundary, timings)
        if root is None:
            return snapshot, None
        b = self.block_size
        parent = hashes[boundary - 1] if boundary else root
        return snapshot, self._read_response(parent, tokens[boundary * b:boundary * b + b - 1], timings)

    def _read_response(self, parent: bytes, following: Sequence[int],
                       timings: Counter) -> tuple[bytes, ResponseEnd] | None:
        match = self._matching_response(parent, following)
        if match is None or match[0] in self.state.snapshots:
            return None
        key, tail_len = match
        tail = tuple(following[:tail_len])
        payload = self.store.read(KIND_RESPONSE, key, tail, timings)
        if payload is None:
            return None
        slot = self.codec.slot_nbytes()
        return key, ResponseEnd(parent, tail, self.codec.snapshot_from_payload(payload[:slot]), bytes(payload[slot:]))

    def _read_snapshot(self, hashes: list[bytes], tokens: list[int], top: int,
                       timings: Counter) -> tuple[bytes, Any] | None:
        """The nearest snapshot on disk below block `top` that beats a zero-mode recompute, unless
        host memory already holds a nearer one (then the plan takes that)."""
        b = self.block_size
        for k in self.state.restore_candidates(top):
            key = hashes[k - 1]
            if key in self.state.snapshots:
                return None
            if self.store.contains(KIND_SNAPSHOT, key):
                payload = self.store.read(KIND_SNAPSHOT, key, tokens[(k - 1) * b:k * b], timings)
                if payload is not None:
                    return key, self.codec.snapshot_from_payload(payload)
        return None
