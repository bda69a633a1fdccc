"""Triton Lightning Indexer scores for any rows of a ragged batch (decodes, and a prefill chunk's
rows, which share one block table): the twin of `indexer.index_scores`.

One program per (query, tile of entries): the keys are gathered through the block table, q·kᵀ for
every head is one `tl.dot`, then relu, the head weights and the sum over heads. Each score is
reduced on its own (fixed order), whatever the batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.launches import interpreting, launch


@triton.jit
def _index_scores_kernel(q_ptr, w_ptr, keys_ptr, tables_ptr, counts_ptr, out_ptr, HI, DI, n, table_stride, w_scale,
                         PER_BLOCK: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
                         BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    heads, dims = tl.arange(0, BLOCK_H), tl.arange(0, BLOCK_D)
    head_ok, dim_ok = heads < HI, dims < DI
    count = tl.load(counts_ptr + r)
    visible = e < count
    q = tl.load(q_ptr + (r * HI + heads[:, None]) * DI + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :],
                other=0.0).to(tl.float32)
    w = tl.load(w_ptr + r * HI + heads, mask=head_ok, other=0.0).to(tl.float32) * w_scale
    blk = tl.load(tables_ptr + r * table_stride + e // PER_BLOCK, mask=visible, other=0)
    k = tl.load(keys_ptr + (blk * PER_BLOCK + e % PER_BLOCK)[:, None] * DI + dims[None, :],
                mask=visible[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
    logits = tl.maximum(tl.dot(q, tl.trans(k), input_precision=PRECISION), 0.0)  # [hI, N]
    scores = tl.sum(logits * w[:, None], axis=0)
    scores = tl.where(visible, scores, float("-inf"))
    tl.store(out_ptr + r * n + e, scores, mask=e < n)


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                 n: int, w_scale: float = 1.0) -> torch.Tensor:
    rows, hi, di = q.shape
    out = torch.empty(rows, n, dtype=torch.float32, device=q.device)
    if rows == 0 or n == 0:
        return out
    block_n = 128 if interpreting() else 32
    if tables.stride(-1) != 1:
        tables = tables.contiguous()
    # A row stride of 0 is one table read by every row (a prefill chunk's rows): never copied.
    launch(_index_scores_kernel[(rows, triton.cdiv(n, block_n))],
           q.contiguous(), w.contiguous(), keys, tables, counts.contiguous(), out, hi, di, n,
           tables.stride(0), w_scale, PER_BLOCK=keys.shape[1], BLOCK_H=max(triton.next_power_of_2(hi), 16),
           BLOCK_D=max(triton.next_power_of_2(di), 16), BLOCK_N=block_n, PRECISION="ieee")
    return out
