"""Batch-invariant building blocks (plain torch) for `--batch-invariant`.

A CPU or GPU GEMM picks its algorithm (gemv or gemm, blocking, split-K) from the row count M, so a
token's projection can change in the last bits with the number of its batch-mates; the MoE makes
that worse (an expert's M is how many tokens chose it) and the indexer's top-k turns such noise
into different entries. Here every row is computed by an identical call on a fresh, aligned copy
of itself: the same call on the same data is deterministic, so a row's result is a function of the
row alone — whatever the batch, the row's place in it or how its prompt was chunked. The price is
one call per row instead of one per batch.

`rowwise` / `linear` / `grouped_linear` have the default (batched) forms beside them; `sparse_attention_rows`
and `index_scores_rows` are per-row twins of `attention.sparse_attention` and
`indexer.index_scores` (same signatures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from v4serve.kernels import quant_linear
from v4serve.kernels.attention import RaggedBatch, attend, gather_entries
from v4serve.kernels.compressor import pool
from v4serve.kernels.kv_fp8 import Record, loaded
from v4serve.kernels.paged import read_entries
from v4serve.kernels.quant_linear import Weight

# The CPU allocator's alignment: a row view at another alignment could take a BLAS code path
# (peeled loads) that rounds differently, so such rows are copied first.
_ALIGN = 64


def _own_row(x: torch.Tensor, i: int) -> torch.Tensor:
    """Row i of x as a [1, ...] tensor laid out as a fresh allocation would be."""
    row = x[i:i + 1]
    if row.is_contiguous() and row.data_ptr() % _ALIGN == 0:
        return row
    return row.clone(memory_format=torch.contiguous_format)


def rowwise(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (elementwise) over x [T, ...] in one call (fast)."""
    return fn(x)


def rowwise_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """fn (elementwise) over x [T, ...], one identical call per row (batch-invariant). Needed for
    transcendental functions: a CPU kernel runs SIMD over most of a tensor and a scalar loop over
    its last few elements, and the two round exp/log differently, so which path an element takes
    depends on where it sits in the batch."""
    if x.shape[0] == 0:
        return fn(x)
    return torch.cat([fn(_own_row(x, i)) for i in range(x.shape[0])])


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, I], weight [O, I] (dense or packed) → [T, O]: one batched GEMM (fast; low bits depend on T)."""
    return quant_linear.linear(x, weight)


def linear_rows(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, I], weight [O, I] (dense or packed) → [T, O], one identical call per row (batch-invariant)."""
    if x.shape[0] == 0:
        return x.new_empty(0, weight.shape[-2])
    return torch.cat([quant_linear.linear(_own_row(x, i), weight) for i in range(x.shape[0])])


def grouped_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, G, I], weight [G, O, I] (or packed [G·O, I]) → [T, G, O]: group g of every row through
    weight[g] (wo_a)."""
    if isinstance(weight, quant_linear.QuantizedWeight):
        return quant_linear.grouped_quant_linear(x, weight)
    # Per group x_g · W_gᵀ, written straight into [T, G, O] rows: flattening the groups afterwards is
    # then a view, not a copy of the whole output at every batch size above one.
    out = x.new_empty(x.shape[0], x.shape[1], weight.shape[1])
    torch.bmm(x.transpose(0, 1), weight.transpose(1, 2), out=out.transpose(0, 1))
    return out


def grouped_linear_rows(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`grouped_linear`, one identical call per row (batch-invariant)."""
    if x.shape[0] == 0:
        return grouped_linear(x, weight)
    return torch.cat([grouped_linear(_own_row(x, i), weight) for i in range(x.shape[0])])


def sparse_attention_rows(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
                          topk: torch.Tensor | None, batch: RaggedBatch, ratio: int, sink: torch.Tensor,
                          scale: float, record: Record | None = None) -> torch.Tensor:
    """Batch-invariant twin of `attention.sparse_attention`: each query alone, over its keys in a
    fixed order (window by position, then its entries), so a decode and the same position inside a
    prefill chunk of any size reduce identically."""
    out = torch.empty_like(q)
    for b, n in enumerate(batch.num_new):
        for i in range(n):
            keys = _row_keys(kv, ring, entries, topk, batch, b, i, ratio, record).to(q.dtype)
            r = batch.offsets[b] + i
            mask = torch.ones(1, keys.shape[0], dtype=torch.bool, device=q.device)
            out[r] = attend(_own_row(q, r), keys, mask, None, None, sink, scale)[0]
    return out


def _row_keys(kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None, topk: torch.Tensor | None,
              batch: RaggedBatch, b: int, i: int, ratio: int, record: Record | None) -> torch.Tensor:
    """The keys query i of sequence b sees → [L, d]: window positions [lo, p] (the ring below the
    sequence's start, this step's keys from it), then HCA's visible entries or CSA's top-k."""
    dev, w = kv.device, ring.shape[1]
    start, first = batch.starts[b], batch.offsets[b]
    p = start + i
    lo = max(p - w + 1, batch.window_from[b], 0)
    held = torch.arange(lo, max(lo, start), device=dev)
    parts = [loaded(ring[batch.slots[b], held % w], record, kv.dtype), kv[first + max(lo, start) - start:first + i + 1]]
    if entries is not None:
        if topk is None:
            index = torch.arange((p + 1) // ratio, device=dev)
        else:
            index = topk[first + i]
            index = index[index >= 0]
        parts.append(loaded(gather_entries(entries, batch.tables[b:b + 1], index[None])[0], record, kv.dtype))
    return torch.cat(parts)


def index_scores_rows(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor,
                      counts: torch.Tensor, n: int, w_scale: float = 1.0) -> torch.Tensor:
    """Batch-invariant twin of `indexer.index_scores`: each query over exactly its own visible
    entries (not padded to the batch's longest), so its scores do not depend on `n`."""
    out = torch.full((q.shape[0], n), float("-inf"), dtype=torch.float32, device=q.device)
    for r, count in enumerate(counts.tolist()):
        if count:
            k = read_entries(keys, tables[r].tolist(), count).float()  # [count, dI]
            logits = torch.matmul(_own_row(q.float(), r)[0], k.t()).relu_()
            out[r, :count] = (_own_row(w.float() * w_scale, r) @ logits)[0]  # Σ_h w·relu(q·k)
    return out


def pool_entries(win_kv: torch.Tensor, win_score: torch.Tensor, index: torch.Tensor, ratio: int, overlap: bool,
                 norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """Batch-invariant twin of `compressor.pool`: each entry pooled by an identical call on its own
    windows. The batched softmax over the slot axis rounds differently with the number of entries
    beside it, so an entry a decode step completes (pooled alone) and the same entry inside a
    prefill chunk (pooled with the chunk's others) would differ in the last bits, and so would
    every later logit that reads it (the indexer's top-k can even pick other entries)."""
    b, w = win_kv.shape[:2]
    span = 2 if overlap else 1  # windows one entry pools
    index = index.expand(b, -1) if index.dim() == 1 else index  # [B, E]
    out = win_kv.new_empty(b, w - span + 1, norm_weight.shape[0])
    for i in range(b):
        for e in range(w - span + 1):
            out[i, e] = pool(win_kv[i:i + 1, e:e + span].clone(), win_score[i:i + 1, e:e + span].clone(),
                             index[i, e:e + 1], ratio, overlap, norm_weight, eps, inv_freq)[0, 0]
    return out
