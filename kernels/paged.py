"""Paged KV reads and writes: every access the model makes to KV storage goes through here.

Two kinds of storage (see `v4serve.cache.device_kv`):
- rings of the State Cache, one per slot: the row of token position p sits at p mod R;
- Block Cache entries, reached through a sequence's block table: entry i of a sequence sits in
  block `table[i // per_block]` at row `i % per_block`.

Plain torch; a fused GPU kernel can replace any of these behind the same signature. Writers and
readers of window rings and entries take the FP8 `record` layout when keys are stored in FP8
(`kernels/kv_fp8.py`), None when they are stored in the compute dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from v4serve.kernels.kv_fp8 import Record, loaded, stored

if TYPE_CHECKING:
    from v4serve.kernels.attention import RaggedBatch


# ---- State Cache rings -------------------------------------------------------------------------------
def ring_write(ring: torch.Tensor, end: int, rows: torch.Tensor, record: Record | None = None) -> None:
    """Store the rows of positions [end − len(rows), end) in ring [R, ...]; only the last R fit."""
    keep = min(len(rows), ring.shape[0])
    if keep == 0:
        return
    index = torch.arange(end - keep, end, device=ring.device) % ring.shape[0]
    ring[index] = stored(rows[-keep:], ring, record)


def ring_read(ring: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Rows of `positions` [n] (all within the last R positions written) from ring [R, ...]."""
    return ring[positions % ring.shape[0]]


def write_window(ring: torch.Tensor, kv: torch.Tensor, batch: RaggedBatch, record: Record | None = None) -> None:
    """A whole ragged batch's new window keys kv [T, d] into the rings [S, W, d]: sequence b's rows
    are positions starts[b].. of slot slots[b]. The twin of `paged_triton.write_window`, which does
    it in one launch."""
    dec = batch.decodes
    if dec.seqs:
        ring_write_batched(ring, dec.slots, dec.positions, batch.decode_rows(kv), record)
    for slot, start, n, offset in zip(batch.slots, batch.starts, batch.num_new, batch.offsets, strict=True):
        if n > 1:
            ring_write(ring[slot], start + n, kv[offset:offset + n], record)


def ring_write_batched(rings: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
                       rows: torch.Tensor, record: Record | None = None) -> None:
    """One row per sequence: rings [S, R, ...], slots [D], positions [D], rows [D, ...]."""
    rings[slots, positions % rings.shape[1]] = stored(rows, rings, record)


def ring_read_batched(rings: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """rings [S, R, ...], slots [D], positions [D, n] → rows [D, n, ...]."""
    return rings[slots[:, None], positions % rings.shape[1]]


# ---- Block Cache entries --------------------------------------------------------------------------------
def write_entries(cache: torch.Tensor, block_table: Sequence[int], first: int, entries: torch.Tensor,
                  record: Record | None = None) -> None:
    """Scatter entries first.. of one sequence into cache [NB, per_block, d] through its block table."""
    if not len(entries):
        return
    per_block = cache.shape[1]
    index = torch.arange(first, first + len(entries))
    blocks = torch.tensor(block_table, dtype=torch.long)[index // per_block]
    cache[blocks.to(cache.device), (index % per_block).to(cache.device)] = stored(entries, cache, record)


def write_entries_batched(cache: torch.Tensor, tables: torch.Tensor, index: torch.Tensor,
                          entries: torch.Tensor, record: Record | None = None) -> None:
    """One entry per sequence: entry `index` [R] of the sequence whose padded block table is row r of
    `tables` [R, nb] ← entries [R, d]."""
    per_block = cache.shape[1]
    blocks = tables.gather(1, (index // per_block)[:, None])[:, 0]
    cache[blocks, index % per_block] = stored(entries, cache, record)


def read_entries(cache: torch.Tensor, block_table: Sequence[int], count: int,
                 record: Record | None = None) -> torch.Tensor:
    """Entries 0..count−1 of one sequence from cache [NB, per_block, d] → [count, d] (fp32)."""
    per_block = cache.shape[1]
    blocks = torch.tensor(block_table[:-(-count // per_block)], dtype=torch.long, device=cache.device)
    return loaded(cache[blocks].flatten(0, 1)[:count], record, torch.float32)


def read_entries_batched(cache: torch.Tensor, tables: torch.Tensor, count: int,
                         record: Record | None = None) -> torch.Tensor:
    """Entries 0..count−1 of several sequences through padded block tables [D, nb] → [D, count, d] (fp32)."""
    nblocks = -(-count // cache.shape[1])
    return loaded(cache[tables[:, :nblocks]].flatten(1, 2)[:, :count], record, torch.float32)
