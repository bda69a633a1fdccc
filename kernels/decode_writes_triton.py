"""Triton twin of `decode_writes.write_decode_step`: a decode step's writes for one layer in one
launch. Program (i, 0) writes decode i's window row; (i, 1) and (i, 2) run its update of the
layer's compressors (the bodies of `paged_triton`'s and `compressor_triton`'s decode kernels, so
each write is bitwise what those kernels write). The three touch disjoint storage."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from v4serve.kernels.compressor_triton import _compress_decode_row, _compressor_args, _decode_args, pooling_warps
from v4serve.kernels.decode_writes import Compression
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.launches import launch
from v4serve.kernels.paged_triton import _window_row, window_args, write_window

if TYPE_CHECKING:
    from v4serve.kernels.attention import RaggedBatch


@triton.jit
def _decode_step_kernel(A, S, C1, C2, W_GROUPS: tl.constexpr, W_PAD: tl.constexpr, W_FP8: tl.constexpr,
                        W_BLOCK_D: tl.constexpr,
                        C1_GROUPS: tl.constexpr, C1_PAD: tl.constexpr, C1_FP8: tl.constexpr, C1_SPAN: tl.constexpr,
                        C1_OVERLAP: tl.constexpr, C1_PER_BLOCK: tl.constexpr, C1_BLOCK_M: tl.constexpr,
                        C1_BLOCK_D: tl.constexpr, C1_BLOCK_CD: tl.constexpr,
                        C2_GROUPS: tl.constexpr, C2_PAD: tl.constexpr, C2_FP8: tl.constexpr, C2_SPAN: tl.constexpr,
                        C2_OVERLAP: tl.constexpr, C2_PER_BLOCK: tl.constexpr, C2_BLOCK_M: tl.constexpr,
                        C2_BLOCK_D: tl.constexpr, C2_BLOCK_CD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    part = tl.program_id(1)
    if part == 0:
        _window_row(i, A, W_GROUPS, W_PAD, W_FP8, W_BLOCK_D)
    elif part == 1:
        _compress_decode_row(i, S, C1, C1_GROUPS, C1_PAD, C1_FP8, C1_SPAN, C1_OVERLAP, C1_PER_BLOCK, C1_BLOCK_M,
                             C1_BLOCK_D, C1_BLOCK_CD)
    else:
        _compress_decode_row(i, S, C2, C2_GROUPS, C2_PAD, C2_FP8, C2_SPAN, C2_OVERLAP, C2_PER_BLOCK, C2_BLOCK_M,
                             C2_BLOCK_D, C2_BLOCK_CD)


def write_decode_step(ring: torch.Tensor, kv: torch.Tensor, batch: RaggedBatch, record: Record | None,
                      compressions: Sequence[Compression], inv_freq: torch.Tensor) -> None:
    assert batch.only_decodes, "a step with prefill chunks writes its window after attention"
    assert len(compressions) <= 2, "a layer has at most two compressors (its own and its indexer's)"
    n = kv.shape[0]
    if n == 0:
        return
    if not compressions:  # a sliding-window layer: the window write is all there is
        write_window(ring, kv, batch, record)
        return
    window, window_consts = window_args(ring, kv, batch, record)
    dec = batch.decodes
    decodes = _decode_args(dec.slots, dec.positions, dec.frozen_until, dec.tables, inv_freq)
    parts = [_compressor_args(c.kv, c.score, c.ring_kv, c.ring_score, c.dest, c.ratio, c.overlap, c.norm_weight,
                              c.eps, c.ape, c.record) for c in compressions]
    # Without an indexer the main compressor's arguments fill C2's place; no program reads them.
    (c1, c1_consts), (c2, c2_consts) = parts[0], parts[-1]
    launch(_decode_step_kernel, (n, 1 + len(parts)), window, decodes, c1, c2,
           **{f"W_{k}": v for k, v in window_consts.items()}, **{f"C1_{k}": v for k, v in c1_consts.items()},
           **{f"C2_{k}": v for k, v in c2_consts.items()},
           num_warps=pooling_warps(compressions[0].norm_weight.shape[0]))

