"""Triton compressor updates: the twins of `compressor.compress_decodes` and `compressor.compress_chunk`
(same signatures).

Decodes: one program per decoding sequence: store its new kv/score row in the pending ring; if the row
completes an entry, pool the entry's rows with an online softmax per channel (the new row is taken
from the input, not read back), RMSNorm, rotate the trailing r dims at position i·m, and write the
entry through the block table. A sequence's result does not depend on its batch-mates.
A prefill chunk: one program per entry the chunk completes, pooling the same way from the rings
(positions before the chunk) and the chunk's rows; then the chunk's last rows go to the rings (a
second launch: an entry may still read a ring row that the chunk's own rows replace).
FP8 entries are written as records by `kv_fp8_triton.store_record`, byte for byte the twin's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.attention_triton import NEG
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.kv_fp8_triton import record_args, store_record
from v4serve.kernels.launches import interpreting, launch


@triton.jit
def _span_tile(j0, last, m, d, dims, SPAN: tl.constexpr, OVERLAP: tl.constexpr, BLOCK_M: tl.constexpr):
    """Rows j0.. of the span of an entry ending at position `last` → (their positions [BLOCK_M],
    which are in the span, and the channel offsets [BLOCK_M, BLOCK_D] they feed: with overlap the
    first m rows feed channels [:d], the last m rows channels [d:])."""
    j = j0 + tl.arange(0, BLOCK_M)
    if OVERLAP:
        chan = tl.where(j < m, 0, d)
    else:
        chan = tl.zeros([BLOCK_M], tl.int64)
    return last - SPAN + 1 + j, j < SPAN, chan[:, None] + dims[None, :]


@triton.jit
def _pool_start(BLOCK_D: tl.constexpr):
    """An empty online softmax per channel: running max, denominator, weighted sum [BLOCK_D]."""
    return tl.full([BLOCK_D], NEG, tl.float32), tl.zeros([BLOCK_D], tl.float32), tl.zeros([BLOCK_D], tl.float32)


@triton.jit
def _pool_step(m_i, l_i, acc, s, k, valid):
    """One tile of rows into the online softmax per channel: scores s and values k [BLOCK_M, BLOCK_D]
    (`valid` where a row holds a token) → the running max, denominator and weighted sum [BLOCK_D]."""
    s = tl.where(valid, s.to(tl.float32), NEG)
    m_new = tl.maximum(m_i, tl.max(s, axis=0))
    alpha = tl.exp(m_i - m_new)
    p = tl.where(valid, tl.exp(s - m_new[None, :]), 0.0)
    return m_new, l_i * alpha + tl.sum(p, axis=0), acc * alpha + tl.sum(p * k.to(tl.float32), axis=0)


@triton.jit
def _normed_rotated(acc, l_i, dims, d, w_ptr, eps, inv_freq_ptr, half, position, BLOCK_D: tl.constexpr):
    """The pooled entry acc / l_i, RMS-normalised, then RoPE on its trailing 2·half dims at
    `position`: pairs (x_2p, x_2p+1), angle of pair p − (d/2 − half)."""
    dim_ok = dims < d
    pooled = tl.where(dim_ok, acc / tl.where(dim_ok, l_i, 1.0), 0.0)
    rs = 1.0 / tl.sqrt(tl.sum(pooled * pooled, axis=0) / d + eps)
    x = pooled * rs * tl.load(w_ptr + dims, mask=dim_ok, other=0.0).to(tl.float32)
    x0, x1 = tl.split(tl.reshape(x, (BLOCK_D // 2, 2)))
    pair = tl.arange(0, BLOCK_D // 2)
    f = pair - (d // 2 - half)
    rot = (f >= 0) & (pair < d // 2)
    angle = position.to(tl.float32) * tl.load(inv_freq_ptr + tl.maximum(f, 0), mask=rot, other=0.0)
    c, sn = tl.cos(angle), tl.sin(angle)
    y0 = tl.where(rot, x0 * c - x1 * sn, x0)
    y1 = tl.where(rot, x1 * c + x0 * sn, x1)
    return tl.reshape(tl.join(y0, y1), (BLOCK_D,))


@triton.jit
def _store_entry(dest_ptr, at, out, dims, d, rope_ptr, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE, ROPE_OFF_BYTES,
                 GROUPS: tl.constexpr, PAD: tl.constexpr, FP8: tl.constexpr):
    """A pooled entry [BLOCK_D] (fp32) into row `at` of the entries: an FP8 record or plain values."""
    if FP8:
        store_record(dest_ptr, rope_ptr, at, out, dims, d, NOPE, STRIDE, ROPE_OFF, ROPE_STRIDE, ROPE_OFF_BYTES,
                     GROUPS, PAD)
    else:
        tl.store(dest_ptr + at * d + dims, out.to(dest_ptr.dtype.element_ty), mask=dims < d)


@triton.jit
def _compress_decode_row(i, S, C, GROUPS: tl.constexpr, PAD: tl.constexpr, FP8: tl.constexpr, SPAN: tl.constexpr,
                         OVERLAP: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_D: tl.constexpr, BLOCK_CD: tl.constexpr):
    """Decoding sequence i's update of one compressor. S: the step's decodes (`_decode_args`);
    C: the compressor (`_compressor_args`)."""
    slots_ptr, pos_ptr, frozen_ptr, tables_ptr, n_tables, inv_freq_ptr, half = S
    (kv_ptr, score_ptr, ape_ptr, ring_kv_ptr, ring_score_ptr, dest_ptr, w_ptr, m, d, CD, R, eps, stride_kv,
     stride_score, rope_ptr, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE, ROPE_OFF_BYTES) = C
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
        m_i, l_i, acc = _pool_start(BLOCK_D)
        for j0 in range(0, SPAN, BLOCK_M):
            pos, in_span, at = _span_tile(j0, t, m, d, dims, SPAN, OVERLAP, BLOCK_M)
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
            m_i, l_i, acc = _pool_step(m_i, l_i, acc, s, k, (held | is_new)[:, None] & dim_ok[None, :])
        out = _normed_rotated(acc, l_i, dims, d, w_ptr, eps, inv_freq_ptr, half, entry * m, BLOCK_D)
        blk = tl.load(tables_ptr + i * n_tables + entry // PER_BLOCK)
        _store_entry(dest_ptr, blk * PER_BLOCK + entry % PER_BLOCK, out, dims, d, rope_ptr, STRIDE, NOPE, ROPE_OFF,
                     ROPE_STRIDE, ROPE_OFF_BYTES, GROUPS, PAD, FP8)


@triton.jit
def _compress_decodes_kernel(S, C, GROUPS: tl.constexpr, PAD: tl.constexpr, FP8: tl.constexpr, SPAN: tl.constexpr,
                             OVERLAP: tl.constexpr, PER_BLOCK: tl.constexpr, BLOCK_M: tl.constexpr,
                             BLOCK_D: tl.constexpr, BLOCK_CD: tl.constexpr):
    _compress_decode_row(tl.program_id(0).to(tl.int64), S, C, GROUPS, PAD, FP8, SPAN, OVERLAP, PER_BLOCK, BLOCK_M,
                         BLOCK_D, BLOCK_CD)


def _decode_args(slots: torch.Tensor, positions: torch.Tensor, frozen_until: torch.Tensor, tables: torch.Tensor,
                 inv_freq: torch.Tensor) -> tuple:
    """The decoding sequences' part of a compressor decode launch (`S` in the kernels)."""
    return (slots, positions, frozen_until, tables.contiguous(), tables.shape[1], inv_freq.to(slots.device),
            inv_freq.shape[0])


def _compressor_args(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                     dest: torch.Tensor, ratio: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                     ape: torch.Tensor, record: Record | None) -> tuple[tuple, dict]:
    """One compressor's part of a launch: its runtime arguments (`C` in the kernels) and its
    compile-time ones. Rings [S, R, c·d]."""
    # Rows may be column slices of a wider projection (read in place); columns must be packed.
    kv, score = (t if t.stride(-1) == 1 else t.contiguous() for t in (kv, score))
    d, cd = norm_weight.shape[0], kv.shape[1]
    fp8 = record_args(record, dest)
    runtime = (kv, score, ape.contiguous(), ring_kv, ring_score, dest, norm_weight, ratio, d, cd, ring_kv.shape[1],
               eps, kv.stride(0), score.stride(0), fp8["rope_ptr"], fp8["STRIDE"], fp8["NOPE"], fp8["ROPE_OFF"],
               fp8["ROPE_STRIDE"], fp8["ROPE_OFF_BYTES"])
    span = 2 * ratio if overlap else ratio
    consts = {"GROUPS": fp8["GROUPS"], "PAD": fp8["PAD"], "FP8": fp8["FP8"], "SPAN": span, "OVERLAP": overlap,
              "PER_BLOCK": dest.shape[1], "BLOCK_M": min(triton.next_power_of_2(span), 128 if interpreting() else 16),
              "BLOCK_D": max(triton.next_power_of_2(d), 2), "BLOCK_CD": triton.next_power_of_2(cd)}
    return runtime, consts


def pooling_warps(d: int) -> int:
    """Warps of a program that pools [BLOCK_M, d] tiles of kv and score: eight at head_dim 512, where
    four would spill those tiles out of registers (bench/aot_check.py), four below."""
    return 8 if d >= 256 else 4


def compress_decodes(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, frozen_until: torch.Tensor, tables: torch.Tensor,
                     dest: torch.Tensor, ratio: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                     inv_freq: torch.Tensor, ape: torch.Tensor, record: Record | None = None) -> None:
    if kv.shape[0] == 0:
        return
    runtime, consts = _compressor_args(kv, score, ring_kv, ring_score, dest, ratio, overlap, norm_weight, eps, ape,
                                       record)
    launch(_compress_decodes_kernel, (kv.shape[0],), _decode_args(slots, positions, frozen_until, tables, inv_freq),
           runtime, **consts, num_warps=pooling_warps(norm_weight.shape[0]))


@triton.jit
def _compress_chunk_kernel(C, table_ptr, inv_freq_ptr, half, start, first, GROUPS: tl.constexpr, PAD: tl.constexpr,
                           FP8: tl.constexpr, SPAN: tl.constexpr, OVERLAP: tl.constexpr, PER_BLOCK: tl.constexpr,
                           BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """One entry the chunk completes. C: `_compressor_args` (its rings one slot's, [1, R, c·d])."""
    (kv_ptr, score_ptr, ape_ptr, ring_kv_ptr, ring_score_ptr, dest_ptr, w_ptr, m, d, CD, R, eps, stride_kv,
     stride_score, rope_ptr, STRIDE, NOPE, ROPE_OFF, ROPE_STRIDE, ROPE_OFF_BYTES) = C
    entry = first + tl.program_id(0).to(tl.int64)
    last = (entry + 1) * m - 1  # the entry's last position
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < d
    m_i, l_i, acc = _pool_start(BLOCK_D)
    for j0 in range(0, SPAN, BLOCK_M):
        pos, in_span, at = _span_tile(j0, last, m, d, dims, SPAN, OVERLAP, BLOCK_M)
        held = in_span & (pos >= 0) & (pos < start)  # pending in the ring (score already biased)
        new = in_span & (pos >= start)  # the chunk's own rows
        held2, new2 = held[:, None] & dim_ok[None, :], new[:, None] & dim_ok[None, :]
        ring_at = (pos % R * CD)[:, None] + at
        row = tl.maximum(pos - start, 0)
        k = tl.where(new[:, None], tl.load(kv_ptr + (row * stride_kv)[:, None] + at, mask=new2, other=0.0),
                     tl.load(ring_kv_ptr + ring_at, mask=held2, other=0.0)).to(tl.float32)
        s = tl.where(new[:, None],
                     tl.load(score_ptr + (row * stride_score)[:, None] + at, mask=new2, other=0.0).to(tl.float32)
                     + tl.load(ape_ptr + (pos % m * CD)[:, None] + at, mask=new2, other=0.0).to(tl.float32),
                     tl.load(ring_score_ptr + ring_at, mask=held2, other=0.0).to(tl.float32))
        m_i, l_i, acc = _pool_step(m_i, l_i, acc, s, k, held2 | new2)
    out = _normed_rotated(acc, l_i, dims, d, w_ptr, eps, inv_freq_ptr, half, entry * m, BLOCK_D)
    blk = tl.load(table_ptr + entry // PER_BLOCK)
    _store_entry(dest_ptr, blk * PER_BLOCK + entry % PER_BLOCK, out, dims, d, rope_ptr, STRIDE, NOPE, ROPE_OFF,
                 ROPE_STRIDE, ROPE_OFF_BYTES, GROUPS, PAD, FP8)


@triton.jit
def _keep_pending_kernel(kv_ptr, score_ptr, ape_ptr, ring_kv_ptr, ring_score_ptr, start, n, keep, m, CD, R,
                         stride_kv, stride_score, BLOCK_CD: tl.constexpr):
    """The chunk's last `keep` rows into the rings (score plus its slot's position bias)."""
    row = n - keep + tl.program_id(0).to(tl.int64)
    pos = start + row
    cols = tl.arange(0, BLOCK_CD)
    ok = cols < CD
    kv = tl.load(kv_ptr + row * stride_kv + cols, mask=ok, other=0.0)
    s = (tl.load(score_ptr + row * stride_score + cols, mask=ok, other=0.0).to(tl.float32)
         + tl.load(ape_ptr + pos % m * CD + cols, mask=ok, other=0.0).to(tl.float32))
    tl.store(ring_kv_ptr + pos % R * CD + cols, kv.to(ring_kv_ptr.dtype.element_ty), mask=ok)
    tl.store(ring_score_ptr + pos % R * CD + cols, s.to(ring_score_ptr.dtype.element_ty), mask=ok)


def compress_chunk(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                   start: int, frozen_until: int, table: torch.Tensor, dest: torch.Tensor, ratio: int,
                   overlap: bool, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, ape: torch.Tensor,
                   record: Record | None = None) -> None:
    n = kv.shape[0]
    if n == 0:
        return
    runtime, consts = _compressor_args(kv, score, ring_kv[None], ring_score[None], dest, ratio, overlap, norm_weight,
                                       eps, ape, record)
    kv, score, ape = runtime[:3]  # packed as the kernels read them
    block_cd = consts.pop("BLOCK_CD")  # the pending rows' width, for the second launch
    first, stop = max(start // ratio, frozen_until // ratio), (start + n) // ratio
    if first < stop:
        launch(_compress_chunk_kernel, (stop - first,), runtime, table.contiguous(), inv_freq.to(kv.device),
               inv_freq.shape[0], start, first, **consts, num_warps=pooling_warps(norm_weight.shape[0]))
    rows, cd = ring_kv.shape[0], kv.shape[1]
    keep = min(n, rows)
    launch(_keep_pending_kernel, (keep,), kv, score, ape, ring_kv, ring_score, start, n, keep, ratio, cd, rows,
           kv.stride(0), score.stride(0), BLOCK_CD=block_cd)
