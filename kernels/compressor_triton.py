"""Triton decode-step compressor update: the twin of `compressor.compress_decodes` (same signature).

One program per decoding sequence: store its new kv/score row in the pending ring; if the row
completes an entry, pool the entry's rows with an online softmax per channel (the new row is taken
from the input, not read back), RMSNorm, rotate the trailing r dims at position i·m, and write the
entry through the block table. A sequence's result does not depend on its batch-mates.
FP8 entries are pooled and encoded by the torch twin (see `paged_triton` for why).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels import compressor
from v4serve.kernels.attention_triton import NEG
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.launches import interpreting, launch


@triton.jit
def _compress_decodes_kernel(kv_ptr, score_ptr, ape_ptr, ring_kv_ptr, ring_score_ptr, slots_ptr, pos_ptr,
                             frozen_ptr, tables_ptr, dest_ptr, w_ptr, inv_freq_ptr, n_tables, m, d, CD, R, half, eps,
                             stride_kv, stride_score,
                             SPAN: tl.constexpr, OVERLAP: tl.constexpr, PER_BLOCK: tl.constexpr,
                             BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_CD: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + i)
    t = tl.load(pos_ptr + i)
    frozen = tl.load(frozen_ptr + i)
    cols = tl.arange(0, BLOCK_CD)
    col_ok = cols < CD
    new_kv = tl.load(kv_ptr + i * stride_kv + cols, mask=col_ok, other=0.0)
    ape_row = ape_ptr + (t % m) * CD  # the slot's position bias joins the score here
    new_score = (tl.load(score_ptr + i * stride_score + cols, mask=col_ok, other=0.0).to(tl.float32)
                 + tl.load(ape_row + cols, mask=col_ok, other=0.0).to(tl.float32))
    ring_row = (slot * R + t % R) * CD
    tl.store(ring_kv_ptr + ring_row + cols, new_kv.to(ring_kv_ptr.dtype.element_ty), mask=col_ok)
    tl.store(ring_score_ptr + ring_row + cols, new_score.to(ring_score_ptr.dtype.element_ty), mask=col_ok)

    entry = (t + 1) // m - 1
    if ((t + 1) % m == 0) & (entry >= frozen // m):
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < d
        m_i = tl.full([BLOCK_D], NEG, tl.float32)
        l_i = tl.zeros([BLOCK_D], tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for j0 in range(0, SPAN, BLOCK_M):
            j = j0 + tl.arange(0, BLOCK_M)
            pos = t - SPAN + 1 + j
            in_span = j < SPAN
            # With overlap the first m rows feed channels [:d], the last m rows channels [d:].
            if OVERLAP:
                chan = tl.where(j < m, 0, d)
            else:
                chan = tl.zeros([BLOCK_M], tl.int64)
            at = chan[:, None] + dims[None, :]
            held = in_span & (pos >= 0) & (pos < t)
            is_new = in_span & (pos == t)
            ring_at = ((slot * R + pos % R) * CD)[:, None] + at
            k = tl.where(is_new[:, None],
                         tl.load(kv_ptr + i * stride_kv + at, mask=is_new[:, None] & dim_ok[None, :], other=0.0),
                         tl.load(ring_kv_ptr + ring_at, mask=held[:, None] & dim_ok[None, :], other=0.0))
            own = is_new[:, None] & dim_ok[None, :]
            s = tl.where(is_new[:, None],
                         tl.load(score_ptr + i * stride_score + at, mask=own, other=0.0).to(tl.float32)
                         + tl.load(ape_row + at, mask=own, other=0.0).to(tl.float32),
                         tl.load(ring_score_ptr + ring_at, mask=held[:, None] & dim_ok[None, :],
                                 other=0.0).to(tl.float32))
            valid = (held | is_new)[:, None] & dim_ok[None, :]
            s = tl.where(valid, s.to(tl.float32), NEG)
            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp(m_i - m_new)
            p = tl.where(valid, tl.exp(s - m_new[None, :]), 0.0)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p * k.to(tl.float32), axis=0)
            m_i = m_new
        pooled = tl.where(dim_ok, acc / tl.where(dim_ok, l_i, 1.0), 0.0)
        rs = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / d + eps)
        x = pooled * rs * tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
        # RoPE on the trailing 2·half dims: pairs (x_2p, x_2p+1), angle of pair p − (d/2 − half).
        x0, x1 = tl.split(tl.reshape(x, (BLOCK_D // 2, 2)))
        pair = tl.arange(0, BLOCK_D // 2)
        f = pair - (d // 2 - half)
        rot = (f >= 0) & (pair < d // 2)
        angle = (entry * m).to(tl.float32) * tl.load(inv_freq_ptr + tl.maximum(f, 0), mask=rot, other=0.0)
        c, sn = tl.cos(angle), tl.sin(angle)
        y0 = tl.where(rot, x0 * c - x1 * sn, x0)
        y1 = tl.where(rot, x1 * c + x0 * sn, x1)
        out = tl.reshape(tl.join(y0, y1), (BLOCK_D,))
        blk = tl.load(tables_ptr + i * n_tables + entry // PER_BLOCK)
        tl.store(dest_ptr + (blk * PER_BLOCK + entry % PER_BLOCK) * d + dims, out.to(dest_ptr.dtype.element_ty),
                 mask=dim_ok)


def compress_decodes(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, frozen_until: torch.Tensor, tables: torch.Tensor,
                     dest: torch.Tensor, ratio: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                     inv_freq: torch.Tensor, ape: torch.Tensor, record: Record | None = None) -> None:
    if record is not None:
        compressor.compress_decodes(kv, score, ring_kv, ring_score, slots, positions, frozen_until, tables, dest,
                                    ratio, overlap, norm_weight, eps, inv_freq, ape, record)
        return
    n = kv.shape[0]
    if n == 0:
        return
    # Rows may be column slices of a wider projection (read in place); columns must be packed.
    kv, score = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, score))
    d, cd, rows = norm_weight.shape[0], kv.shape[1], ring_kv.shape[1]
    span = 2 * ratio if overlap else ratio
    block_m = min(triton.next_power_of_2(span), 128 if interpreting() else 16)
    launch(_compress_decodes_kernel[(n,)],
           kv, score, ape.contiguous(), ring_kv, ring_score, slots, positions, frozen_until, tables.contiguous(),
           dest, norm_weight, inv_freq.to(kv.device), tables.shape[1], ratio, d, cd, rows, inv_freq.shape[0], eps,
           kv.stride(0), score.stride(0), SPAN=span, OVERLAP=overlap, PER_BLOCK=dest.shape[1], BLOCK_M=block_m,
           BLOCK_D=max(triton.next_power_of_2(d), 2), BLOCK_CD=triton.next_power_of_2(cd))
