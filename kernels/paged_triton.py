"""Triton paged writes: the twin of `paged.write_window` (same signature). FP8 windows are written
as records by `kv_fp8_triton.store_record`, byte for byte the twin's."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.attention import RaggedBatch
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.kv_fp8_triton import record_args, store_record
from v4serve.kernels.launches import launch


@triton.jit
def _window_row(r, A, GROUPS: tl.constexpr, PAD: tl.constexpr, FP8: tl.constexpr, BLOCK_D: tl.constexpr):
    """Batch row r's key into its sequence's window ring. A: `_window_args`."""
    (kv_ptr, ring_ptr, row_seq_ptr, row_pos_ptr, info_ptr, D, W, rope_ptr, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE,
     ROPE_OFF_BYTES) = A
    b = tl.load(row_seq_ptr + r)
    p = tl.load(row_pos_ptr + r)
    slot = tl.load(info_ptr + b * 5)
    end = tl.load(info_ptr + b * 5 + 1) + tl.load(info_ptr + b * 5 + 4)
    if p >= end - W:  # earlier rows of a long chunk would be overwritten anyway: skipping them avoids a race
        dims = tl.arange(0, BLOCK_D)
        row = tl.load(kv_ptr + r * D + dims, mask=dims < D, other=0.0)
        if FP8:
            store_record(ring_ptr, rope_ptr, slot * W + p % W, row.to(tl.float32), dims, D, NOPE, STRIDE, ROPE_OFF,
                         ROPE_STRIDE, ROPE_OFF_BYTES, GROUPS, PAD)
        else:
            tl.store(ring_ptr + (slot * W + p % W) * D + dims, row.to(ring_ptr.dtype.element_ty), mask=dims < D)


@triton.jit
def _write_window_kernel(A, GROUPS: tl.constexpr, PAD: tl.constexpr, FP8: tl.constexpr, BLOCK_D: tl.constexpr):
    _window_row(tl.program_id(0).to(tl.int64), A, GROUPS, PAD, FP8, BLOCK_D)


def window_args(ring: torch.Tensor, kv: torch.Tensor, batch: RaggedBatch, record: Record | None) -> tuple[tuple, dict]:
    """A window write's runtime arguments (`A` in the kernels) and compile-time ones."""
    fp8 = record_args(record, ring)
    runtime = (kv.contiguous(), ring, batch.row_seq, batch.row_pos, batch.seq_info, kv.shape[1], ring.shape[1],
               fp8["rope_ptr"], fp8["STRIDE"], fp8["NOPE"], fp8["ROPE_OFF"], fp8["ROPE_STRIDE"], fp8["ROPE_OFF_BYTES"])
    consts = {"GROUPS": fp8["GROUPS"], "PAD": fp8["PAD"], "FP8": fp8["FP8"],
              "BLOCK_D": triton.next_power_of_2(kv.shape[1])}
    return runtime, consts


def write_window(ring: torch.Tensor, kv: torch.Tensor, batch: RaggedBatch, record: Record | None = None) -> None:
    """ring [S, W, d] (FP8 records [S, W, bytes] under `record`) ← kv [T, d] at (slot, position mod W)
    of each row."""
    if kv.shape[0] == 0:
        return
    runtime, consts = window_args(ring, kv, batch, record)
    launch(_write_window_kernel, (kv.shape[0],), runtime, **consts)
