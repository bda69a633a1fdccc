"""Triton paged writes: the twin of `paged.write_window` (same signature).

FP8 windows are written by the torch twin: the interpreter rounds float→e4m3 differently from
torch and the GPU, so an encoding kernel could not be checked against its twin on a CPU."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels import paged
from v4serve.kernels.attention import RaggedBatch
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.launches import launch


@triton.jit
def _write_window_kernel(kv_ptr, ring_ptr, row_seq_ptr, row_pos_ptr, info_ptr, D, W, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    b = tl.load(row_seq_ptr + r)
    p = tl.load(row_pos_ptr + r)
    slot = tl.load(info_ptr + b * 5)
    end = tl.load(info_ptr + b * 5 + 1) + tl.load(info_ptr + b * 5 + 4)
    if p >= end - W:  # earlier rows of a long chunk would be overwritten anyway: skipping them avoids a race
        dims = tl.arange(0, BLOCK_D)
        row = tl.load(kv_ptr + r * D + dims, mask=dims < D, other=0.0)
        tl.store(ring_ptr + (slot * W + p % W) * D + dims, row.to(ring_ptr.dtype.element_ty), mask=dims < D)


def write_window(ring: torch.Tensor, kv: torch.Tensor, batch: RaggedBatch, record: Record | None = None) -> None:
    """ring [S, W, d] ← kv [T, d] at (slot, position mod W) of each row."""
    t, d = kv.shape
    if record is not None:
        paged.write_window(ring, kv, batch, record)
        return
    if t == 0:
        return
    launch(_write_window_kernel[(t,)], kv.contiguous(), ring, batch.row_seq, batch.row_pos, batch.seq_info, d,
           ring.shape[1], BLOCK_D=triton.next_power_of_2(d))
