"""The KV tensors on the device, behind the plain-Python bookkeeping: preallocated once, State Cache
tensors indexed by slot, Block Cache tensors by block id. The model reads and writes them through
`v4serve.kernels.paged`; host snapshots and SSD-store payloads are copied in and out here."""

from __future__ import annotations

import sys
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from v4serve.cache.layout import KVLayout, LayerLayout
from v4serve.cache.ssd_reader import ContiguousRows


@dataclass
class LayerKV:
    """One layer's tensors. Per-slot (State Cache) tensors lead with the slot axis, Block Cache
    tensors with the block axis. Absent parts are None (a window-only layer has no compressor)."""

    layout: LayerLayout
    window: torch.Tensor  # [S, window, d], or FP8 key records [S, window, bytes] (layout.KVRecord)
    pending_kv: torch.Tensor | None = None  # [S, rows, c·d]
    pending_score: torch.Tensor | None = None  # [S, rows, c·d]
    index_pending_kv: torch.Tensor | None = None  # [S, 2m, 2·dI]
    index_pending_score: torch.Tensor | None = None  # [S, 2m, 2·dI]
    entries: torch.Tensor | None = None  # [NB, B/m, d], or FP8 key records [NB, B/m, bytes]
    index_keys: torch.Tensor | None = None  # [NB, B/m, dI]
    hidden: torch.Tensor | None = None  # [S, hc, D]: a multi-token-prediction layer's input state

    def slot_tensors(self) -> list[torch.Tensor]:
        parts = (self.window, self.pending_kv, self.pending_score, self.index_pending_kv,
                 self.index_pending_score, self.hidden)
        return [t for t in parts if t is not None]

    def block_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.entries, self.index_keys) if t is not None]


class DeviceKV:
    """All KV tensors of all layers: `num_slots` State Cache slots and `num_blocks` blocks."""

    def __init__(self, layout: KVLayout, num_slots: int, num_blocks: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.layers = [self._alloc(layer) for layer in layout.layers]
        self._kept: dict[int, list[torch.Tensor]] = {}  # slots' states before a drafted pass (`keep_slots`)
        self._host_rows = HostRows()

    def _alloc(self, layer: LayerLayout) -> LayerKV:
        def zeros(name: str, lead: int, shape: tuple[int, ...]) -> torch.Tensor:
            dtype = torch.uint8 if layer.packed(name) else self.dtype  # FP8 records are bytes
            return torch.zeros(lead, *shape, dtype=dtype, device=self.device)

        tensors = {name: zeros(name, self.num_slots, shape) for name, shape in layer.slot_shapes().items()}
        tensors |= {name: zeros(name, self.num_blocks, shape) for name, shape in layer.block_shapes().items()}
        return LayerKV(layout=layer, **tensors)

    def read_slot(self, slot: int) -> torch.Tensor:
        """A host copy of one slot's whole state (a snapshot): the bytes of its parts in a fixed order,
        as one uint8 tensor (one object per snapshot for the cycle collector to walk, not one per part:
        thousands of snapshots are held)."""
        return slot_bytes([t[slot] for t in self._slot_parts()]).to("cpu")

    def copy_slot(self, slot: int) -> list[torch.Tensor]:
        """A copy of one slot's whole state on its own device (put back with `write_slot`)."""
        return [t[slot].clone() for t in self._slot_parts()]

    def keep_slots(self, slots: list[int]) -> None:
        """Copy these slots' states on the device before a drafted pass, in place of those kept for the
        pass before: what `restore_kept` puts back if a draft is rejected. Every rank keeps its own, so
        a rejection sends no state between ranks."""
        self._kept = {slot: self.copy_slot(slot) for slot in slots}

    def restore_kept(self, slot: int) -> None:
        self.write_slot(slot, self._kept.pop(slot))

    def slot_nbytes(self) -> int:
        return self.layout.state_bytes_per_slot(self.itemsize)

    def block_nbytes(self) -> int:
        return self.layout.block_bytes(self.itemsize)

    def clear_slot(self, slot: int) -> None:
        """Zero a slot so nothing of its previous owner can leak into a new request."""
        for t in self._slot_parts():
            t[slot].zero_()

    def write_slot(self, slot: int, state: torch.Tensor | list[torch.Tensor]) -> None:
        """Put back a snapshot (`read_slot`'s bytes) or a device copy (`copy_slot`'s parts)."""
        parts = self._slot_parts()
        if isinstance(state, torch.Tensor):
            if state.numel() != self.slot_nbytes():
                raise ValueError(f"snapshot has {state.numel()} bytes, layout needs {self.slot_nbytes()}")
            at = 0
            for dst in parts:
                n = _row_bytes(dst)
                dst[slot].view(-1).view(torch.uint8).copy_(state[at:at + n], non_blocking=True)
                at += n
            return
        if len(parts) != len(state):
            raise ValueError(f"snapshot has {len(state)} tensors, layout needs {len(parts)}")
        for dst, src in zip(parts, state, strict=True):
            dst[slot].copy_(src, non_blocking=True)

    def _slot_parts(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.slot_tensors()]

    def _block_parts(self) -> list[torch.Tensor]:
        return [t for layer in self.layers for t in layer.block_tensors()]

    # ---- bytes for the SSD store ------------------------------------------------------------------
    def layout_descriptor(self) -> bytes:
        """Shapes and dtypes of one block's and one slot's tensors: a file written under any other
        layout must never be read as this one."""
        blocks = [(tuple(t.shape[1:]), str(t.dtype)) for t in self._block_parts()]
        slots = [(tuple(t.shape[1:]), str(t.dtype)) for t in self._slot_parts()]
        return repr((self.layout.block_size, blocks, slots)).encode()

    def block_payload(self, block_id: int) -> CopyingPayload:
        """Host bytes of one block across all layers, copied now (the block may be reused later) but
        read later: on a GPU the copy is queued behind the step that wrote the block, and whoever
        reads the bytes (the SSD store's writer thread) waits for it, not the engine."""
        return CopyingPayload.of([t[block_id] for t in self._block_parts()])

    def block_rows(self, n: int) -> tuple[torch.Tensor, ContiguousRows]:
        """Host memory for n blocks, one row of bytes per block (pinned when the storage is on a GPU,
        so the install copies asynchronously), and a writable view of each row: a store file's
        payload is read straight into its row, with no copy after the read."""
        if self.device.type == "cuda":  # the pinned caching allocator reuses its blocks once their copies are done
            rows = torch.empty((n, self._block_nbytes()), dtype=torch.uint8, pin_memory=True)
        else:
            rows = self._host_rows.take(n * self._block_nbytes()).view(n, self._block_nbytes())
        return rows, ContiguousRows(memoryview(rows.numpy().reshape(-1)), self._block_nbytes(), n)

    def reserve_host_rows(self, nbytes: int) -> None:
        """Make the host memory for loads of up to `nbytes` of blocks now (on a CPU: see `HostRows`)."""
        if self.device.type != "cuda":
            self._host_rows.reserve(nbytes)

    def blocks_from_rows(self, rows: torch.Tensor, n: int) -> list[torch.Tensor]:
        """The first n rows as host tensors [n, ...], one per storage tensor: views, not copies."""
        out, offset = [], 0
        for t in self._block_parts():
            width = _row_bytes(t)
            out.append(rows[:n, offset:offset + width].view(t.dtype).view(n, *t.shape[1:]))
            offset += width
        return out

    def stack_block_payloads(self, payloads: list[memoryview]) -> list[torch.Tensor]:
        """Host tensors [n, ...] per storage tensor from n block payloads (one byte copy per block)."""
        rows, views = self.block_rows(len(payloads))
        for view, payload in zip(views, payloads, strict=True):
            view[:] = payload
        return self.blocks_from_rows(rows, len(payloads))

    def _block_nbytes(self) -> int:
        return sum(_row_bytes(t) for t in self._block_parts())

    def install_blocks(self, block_ids: list[int], stacked: list[torch.Tensor]) -> None:
        """Copy blocks read from the store into the Block Cache: one copy per storage tensor, or on a CPU,
        where the ids mostly run in order, one per run of consecutive ids (a slice copy took half an
        `index_copy_`'s time: 0.6 against 1.2 ms for 512 blocks)."""
        runs = _id_runs(block_ids)
        if self.device.type == "cpu" and len(runs) <= MAX_COPY_RUNS:
            for dst, src in zip(self._block_parts(), stacked, strict=True):
                for first, start, count in runs:
                    dst[first:first + count].copy_(src[start:start + count])
            return
        index = torch.tensor(block_ids, dtype=torch.long, device=self.device)
        for dst, src in zip(self._block_parts(), stacked, strict=True):
            dst.index_copy_(0, index, src[: len(block_ids)].to(dst.device, non_blocking=True))

    @staticmethod
    def snapshot_payload(state: torch.Tensor) -> list[memoryview]:
        return [_as_bytes(state)]

    def snapshot_from_payload(self, payload: memoryview) -> torch.Tensor:
        """A host snapshot (as `read_slot` returns) from store bytes."""
        return torch.frombuffer(payload, dtype=torch.uint8, count=self.slot_nbytes()).clone()


class HostRows:
    """Host memory for blocks read from the store on a CPU device, kept from load to load: fresh memory
    faults in page by page as the reader's payloads are copied into it (~1.4 ms of a 16K-token hit's
    3.3 MB here, on the loader's thread while the reader process wants the same two cores), kept
    memory does not. A kept buffer is taken again only once nothing made on it is left: every tensor
    and view on a buffer holds a reference to it (its buffer export), so a buffer is free exactly when
    its reference count is back to what it was with nothing on it. At most KEEP buffers of up to
    MAX_KEPT_BYTES are kept; a larger or further one is the load's alone."""

    KEEP = 2
    MAX_KEPT_BYTES = 64 << 20

    def __init__(self) -> None:
        self._kept: list[bytearray] = []
        self._free_refs = 0  # a kept buffer's reference count with nothing made on it (`_refs`)
        self._lock = threading.Lock()  # loads on two loader threads: a buffer goes to one of them

    def take(self, nbytes: int) -> torch.Tensor:
        """`nbytes` of host memory as a uint8 tensor, from a kept buffer when one is free (a free one too
        small is replaced by a larger one)."""
        if nbytes == 0:  # a load of no blocks (only a response end): torch.frombuffer takes no empty count
            return torch.empty(0, dtype=torch.uint8)
        with self._lock:
            free = [i for i in range(len(self._kept)) if self._refs(i) == self._free_refs]
            for i in free:
                if len(self._kept[i]) >= nbytes:
                    return torch.frombuffer(self._kept[i], dtype=torch.uint8, count=nbytes)
            if nbytes > self.MAX_KEPT_BYTES or (not free and len(self._kept) >= self.KEEP):
                return torch.empty(nbytes, dtype=torch.uint8)
            if free:
                self._kept[free[0]] = bytearray(nbytes)
            else:
                self._kept.append(bytearray(nbytes))
            i = free[0] if free else len(self._kept) - 1
            self._free_refs = self._refs(i)
            return torch.frombuffer(self._kept[i], dtype=torch.uint8, count=nbytes)

    def __reduce__(self) -> tuple[type[HostRows], tuple[()]]:
        # A copy of the KV tensors (a test's eager twin) gets host memory of its own, made as it needs.
        return HostRows, ()

    def reserve(self, nbytes: int) -> None:
        """A buffer of `nbytes` (at most MAX_KEPT_BYTES) made now, at start, not at the first load."""
        with self._lock:
            if not self._kept and nbytes > 0:
                self._kept.append(bytearray(min(nbytes, self.MAX_KEPT_BYTES)))
                self._free_refs = self._refs(0)

    def _refs(self, i: int) -> int:
        # Measured through this one helper, never as an absolute number: what the interpreter counts
        # for a call's argument differs from version to version.
        return sys.getrefcount(self._kept[i])


class CopyingPayload(Sequence[memoryview]):
    """Host bytes on their way from the device: reading them first waits for their copy alone."""

    def __init__(self, parts: list[torch.Tensor], done: torch.cuda.Event | None) -> None:
        self._parts, self._done = parts, done
        self._views: list[memoryview] | None = None

    @classmethod
    def of(cls, sources: list[torch.Tensor]) -> CopyingPayload:
        """The sources' bytes, one after another, in one host buffer: gathered on their device by one
        concatenation, then one copy (on a GPU into pinned memory, queued on the stream: the host goes
        on). A buffer and a copy per source cost a block's sealing more than the bytes do."""
        joined = torch.cat([t.reshape(-1).view(torch.uint8) for t in sources])
        if joined.device.type != "cuda":
            return cls([joined], None)
        host = torch.empty(joined.shape, dtype=torch.uint8, pin_memory=True)
        host.copy_(joined, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        return cls([host], done)

    def _ready(self) -> list[memoryview]:
        if self._views is None:
            if self._done is not None:
                self._done.synchronize()
            self._views = [memoryview(p.numpy()) for p in self._parts]
        return self._views

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        return self._ready()[i]

    def __len__(self) -> int:
        return len(self._parts)

    def __iter__(self) -> Iterator[memoryview]:
        return iter(self._ready())


MAX_COPY_RUNS = 8  # runs of consecutive block ids an install copies slice by slice (more: one index_copy_)


def _id_runs(ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(first id, index in `ids`, length) of each run of consecutive ids."""
    runs: list[tuple[int, int, int]] = []
    for i, block_id in enumerate(ids):
        if runs and runs[-1][0] + runs[-1][2] == block_id:
            runs[-1] = (runs[-1][0], runs[-1][1], runs[-1][2] + 1)
        else:
            runs.append((block_id, i, 1))
    return runs


def slot_bytes(parts: list[torch.Tensor]) -> torch.Tensor:
    """One slot's parts (each contiguous) as one uint8 tensor of their bytes, in order."""
    return torch.cat([p.reshape(-1).view(torch.uint8) for p in parts])


def _row_bytes(t: torch.Tensor) -> int:
    """Bytes of one slot's or one block's part of a storage tensor."""
    return t[0].numel() * t.element_size()


def _as_bytes(t: torch.Tensor) -> memoryview:
    return memoryview(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy())
