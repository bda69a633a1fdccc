"""Triton sparse attention over a ragged batch: the twin of `attention.sparse_attention` (same
signature, same semantics; see that module for what each query attends to).

One program per (query row, tile of heads): an online softmax over key tiles — first the window
(ring rows below the sequence's start, this step's keys above it), then the compressed entries read
through the block table (CSA: the indexer's top-k; HCA: every visible entry) — then the sink
joins the denominator. K = V, so each key tile is loaded once. A row's reduction order depends only
on its own position and keys, never on its batch-mates or on how its prompt was chunked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.attention import RaggedBatch
from v4serve.kernels.codes_triton import e4m3, e8m0
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.kv_fp8_triton import record_args
from v4serve.kernels.launches import interpreting, launch

# A finite "−inf": a fully masked tile must not turn the running max into NaN. Globals read inside
# a compiled kernel must be constexpr.
NEG = tl.constexpr(-1.0e30)


@triton.jit
def _online_update(q, k, valid, m_i, l_i, acc, scale, PRECISION: tl.constexpr):
    """Fold one key tile k [N, D] (valid [N]) into the running max/denominator/numerator of q [H, D]."""
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale  # [H, N]
    s = tl.where(valid[None, :], s, NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid[None, :], tl.exp(s - m_new[:, None]), 0.0)
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(k.dtype), k, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _load_keys(ptr, rope_ptr, rows, dims, mask, D, FP8: tl.constexpr, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE):
    """Keys at storage rows `rows` [N] → [N, BLOCK_D] fp32. FP8 records (kv_fp8.py) are decoded here:
    e4m3 codes times their group's power-of-two scale (both built from bits, exactly as torch
    decodes them), then the rope channels read through `rope_ptr`, the same bytes viewed in the
    rope dtype."""
    if FP8:
        nope = dims < NOPE
        at = rows[:, None] * STRIDE
        code = tl.load(ptr + at + dims[None, :], mask=mask & nope[None, :], other=0).to(tl.int32)
        exponent = tl.load(ptr + at + NOPE + dims[None, :] // 64, mask=mask & nope[None, :], other=127).to(tl.int32)
        value = e4m3(code) * e8m0(exponent)
        rope = tl.load(rope_ptr + rows[:, None] * ROPE_STRIDE + ROPE_OFF + (dims[None, :] - NOPE),
                       mask=mask & (~nope & (dims < D))[None, :], other=0.0)
        return tl.where(nope[None, :], value, rope.to(tl.float32))
    else:
        return tl.load(ptr + rows[:, None] * D + dims[None, :], mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _sparse_attention_kernel(q_ptr, kv_ptr, ring_ptr, ring_rope_ptr, entries_ptr, entries_rope_ptr, topk_ptr,
                             tables_ptr, row_seq_ptr, row_pos_ptr, info_ptr, sink_ptr, out_ptr, H, D, W, ratio,
                             n_tables, scale, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE,
                             TOPK: tl.constexpr, PER_BLOCK: tl.constexpr, HAS_ENTRIES: tl.constexpr,
                             HAS_TOPK: tl.constexpr, FP8: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
                             BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, BLOCK_D)
    head_ok, dim_ok = heads < H, dims < D
    b = tl.load(row_seq_ptr + r)
    p = tl.load(row_pos_ptr + r)
    slot = tl.load(info_ptr + b * 5)
    start = tl.load(info_ptr + b * 5 + 1)
    offset = tl.load(info_ptr + b * 5 + 2)
    window_from = tl.load(info_ptr + b * 5 + 3)
    q = tl.load(q_ptr + (r * H + heads[:, None]) * D + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :],
                other=0.0)
    m_i = tl.full([BLOCK_H], NEG, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)

    # Window: positions [lo, p]; below `start` from the ring, from this step's keys above.
    lo = tl.maximum(tl.maximum(p - W + 1, window_from), 0)
    for j0 in range(lo, p + 1, BLOCK_N):
        j = j0 + tl.arange(0, BLOCK_N)
        valid = j <= p
        new = j >= start
        from_kv = tl.load(kv_ptr + (offset + j - start)[:, None] * D + dims[None, :],
                          mask=(valid & new)[:, None] & dim_ok[None, :], other=0.0)
        from_ring = _load_keys(ring_ptr, ring_rope_ptr, slot * W + j % W, dims,
                               (valid & ~new)[:, None] & dim_ok[None, :], D, FP8, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE)
        k = tl.where(new[:, None], from_kv.to(q.dtype), from_ring.to(q.dtype))
        m_i, l_i, acc = _online_update(q, k, valid, m_i, l_i, acc, scale, PRECISION)

    # Compressed entries through the block table.
    if HAS_ENTRIES:
        if HAS_TOPK:
            for e0 in range(0, TOPK, BLOCK_N):
                slots_k = e0 + tl.arange(0, BLOCK_N)
                e = tl.load(topk_ptr + r * TOPK + slots_k, mask=slots_k < TOPK, other=-1)
                valid = e >= 0
                e = tl.maximum(e, 0)
                blk = tl.load(tables_ptr + b * n_tables + e // PER_BLOCK, mask=valid, other=0)
                k = _load_keys(entries_ptr, entries_rope_ptr, blk * PER_BLOCK + e % PER_BLOCK, dims,
                               valid[:, None] & dim_ok[None, :], D, FP8, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE)
                m_i, l_i, acc = _online_update(q, k.to(q.dtype), valid, m_i, l_i, acc, scale, PRECISION)
        else:
            count = (p + 1) // ratio
            for e0 in range(0, count, BLOCK_N):
                e = e0 + tl.arange(0, BLOCK_N)
                valid = e < count
                blk = tl.load(tables_ptr + b * n_tables + e // PER_BLOCK, mask=valid, other=0)
                k = _load_keys(entries_ptr, entries_rope_ptr, blk * PER_BLOCK + e % PER_BLOCK, dims,
                               valid[:, None] & dim_ok[None, :], D, FP8, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE)
                m_i, l_i, acc = _online_update(q, k.to(q.dtype), valid, m_i, l_i, acc, scale, PRECISION)

    # The sink: one more logit per head in the denominator, nothing in the numerator.
    sink = tl.load(sink_ptr + heads, mask=head_ok, other=0.0).to(tl.float32)
    m_new = tl.maximum(m_i, sink)
    alpha = tl.exp(m_i - m_new)
    l_i = l_i * alpha + tl.exp(sink - m_new)
    out = acc * alpha[:, None] / l_i[:, None]
    tl.store(out_ptr + (r * H + heads[:, None]) * D + dims[None, :], out.to(out_ptr.dtype.element_ty),
             mask=head_ok[:, None] & dim_ok[None, :])


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
                     topk: torch.Tensor | None, batch: RaggedBatch, ratio: int, sink: torch.Tensor,
                     scale: float, record: Record | None = None) -> torch.Tensor:
    """q [T, H, d], kv [T, d], ring [S, W, d], entries [NB, P, d] or None, topk [T, k] or None,
    sink [H] → out [T, H, d]. Under an FP8 `record` layout ring and entries hold records [..., bytes]."""
    t, h, d = q.shape
    out = torch.empty_like(q)
    if t == 0:
        return out
    block_h = 16  # tl.dot's smallest tile; fewer heads are masked
    has_entries, has_topk = entries is not None, topk is not None
    entries_t = entries if entries is not None else ring  # any tensor: never read without entries
    topk_t = topk.contiguous() if topk is not None else batch.row_seq
    ring_fp8, entries_fp8 = record_args(record, ring), record_args(record, entries_t)
    launch(_sparse_attention_kernel, (t, triton.cdiv(h, block_h)),
           q.contiguous(), kv.contiguous(), ring, ring_fp8["rope_ptr"], entries_t, entries_fp8["rope_ptr"], topk_t,
           batch.tables, batch.row_seq, batch.row_pos, batch.seq_info, sink, out, h, d, ring.shape[1],
           max(ratio, 1), batch.tables.shape[1], scale, ring_fp8["STRIDE"], ring_fp8["NOPE"], ring_fp8["ROPE_OFF"],
           ring_fp8["ROPE_STRIDE"], TOPK=topk.shape[1] if topk is not None else 1, PER_BLOCK=entries_t.shape[1],
           HAS_ENTRIES=has_entries, HAS_TOPK=has_topk, FP8=record is not None, BLOCK_H=block_h,
           BLOCK_D=max(triton.next_power_of_2(d), 16), PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
           **_tiles())
    return out


def _tiles() -> dict[str, int]:
    """Key tiles and warps. On a GPU at head_dim 512 a program holds its queries and running output
    ([16, 512] each) and a key tile: 16-key tiles over 8 warps keep that in registers, and two
    pipeline stages in an A100's shared memory (bench/aot_check.py checks both for every target).
    The interpreter pays per op: the widest tiles."""
    if interpreting():
        return {"BLOCK_N": 128}
    return {"BLOCK_N": 16, "num_warps": 8, "num_stages": 2}

