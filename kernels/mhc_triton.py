"""Triton kernels for mHC (see `mhc.py`, their plain-torch twin): the pre step is two launches per
layer part (the RMS-normalised mixing's dot products split over K; then the sigmoid gates, every
Sinkhorn iteration and the collapse Σ_k pre_k h_k), and the post step one. A program takes a tile
of tokens but reduces each token's row on its own, in a fixed order, so a token's result does not
depend on its batch-mates."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.launches import interpreting, launch

# Slices of K = HC·D the mixing's dot products are split into on a GPU (a power of two): enough programs
# to fill the SMs at batch 1, and fixed, so a token's sums never depend on the batch.
MIX_SPLITS = 64


@triton.jit
def _mhc_mix_kernel(h_ptr, fn_ptr, part_ptr, T, K, KS, R: tl.constexpr, RP: tl.constexpr, BLOCK_T: tl.constexpr,
                    BLOCK: tl.constexpr):
    """One token tile's partial sums over one slice of the K = HC·D inputs (split-K: a single program
    walking all of K is latency-bound, ~0.5 ms a call at V4's widths): the R mixing rows' dot products
    and the sum of squares → part[split, token, :R] and part[split, token, R]. The slices depend on K
    alone, so a token's sums do not depend on its batch-mates."""
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1).to(tl.int64)
    tok_ok = tok < T
    r = tl.arange(0, RP)
    acc = tl.zeros([BLOCK_T, RP], tl.float32)
    sq = tl.zeros([BLOCK_T], tl.float32)
    k_lo = split * KS
    for k0 in range(0, KS, BLOCK):
        offs = k_lo + k0 + tl.arange(0, BLOCK)
        live = offs < K
        hv = tl.load(h_ptr + tok[:, None] * K + offs[None, :], mask=tok_ok[:, None] & live[None, :],
                     other=0.0).to(tl.float32)  # [BT, BK]
        w = tl.load(fn_ptr + r[:, None] * K + offs[None, :], mask=(r < R)[:, None] & live[None, :],
                    other=0.0).to(tl.float32)  # [RP, BK]
        acc += tl.sum(w[None, :, :] * hv[:, None, :], axis=2)
        sq += tl.sum(hv * hv, axis=1)
    row = part_ptr + (split * T + tok) * RP
    tl.store(row[:, None] + r[None, :], tl.where(r[None, :] == R, sq[:, None], acc), mask=tok_ok[:, None])


@triton.jit
def _mhc_pre_kernel(h_ptr, part_ptr, base_ptr, scale_ptr, norm_w_ptr, x_ptr, gates_ptr, T, D, hc_eps, norm_eps,
                    HC: tl.constexpr, RP: tl.constexpr, SPLITS: tl.constexpr, ITERS: tl.constexpr,
                    NORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    tok_ok = tok < T
    K = HC * D
    i = tl.arange(0, HC)
    ij = tl.arange(0, HC * HC)
    # The mixing kernel's partial sums, added in split order: [SPLITS, BT] rows of RP.
    at = part_ptr + (tl.arange(0, SPLITS).to(tl.int64)[:, None] * T + tok[None, :]) * RP
    some = tok_ok[None, :, None]
    mix_pre = tl.sum(tl.load(at[:, :, None] + i[None, None, :], mask=some, other=0.0), axis=0)  # [BT, HC]
    mix_post = tl.sum(tl.load(at[:, :, None] + HC + i[None, None, :], mask=some, other=0.0), axis=0)
    mix_comb = tl.sum(tl.load(at[:, :, None] + 2 * HC + ij[None, None, :], mask=some, other=0.0), axis=0)
    sq = tl.sum(tl.load(at + 2 * HC + HC * HC, mask=tok_ok[None, :], other=0.0), axis=0)  # [BT]
    rs = 1.0 / tl.sqrt(sq / K + norm_eps)  # [BT]
    s_pre = tl.load(scale_ptr)
    s_post = tl.load(scale_ptr + 1)
    s_comb = tl.load(scale_ptr + 2)
    pre = tl.sigmoid(mix_pre * rs[:, None] * s_pre + tl.load(base_ptr + i)[None, :]) + hc_eps
    post = 2.0 * tl.sigmoid(mix_post * rs[:, None] * s_post + tl.load(base_ptr + HC + i)[None, :])
    z = mix_comb * rs[:, None] * s_comb + tl.load(base_ptr + 2 * HC + ij)[None, :]
    z = tl.reshape(z, (BLOCK_T, HC, HC))  # [t, j, k]: softmax over k
    z = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    comb = z / tl.sum(z, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    # post and comb share one row per token: [post (HC) | comb (HC·HC)].
    tl.store(gates_ptr + tok[:, None] * (HC + HC * HC) + i[None, :], post, mask=tok_ok[:, None])
    tl.store(gates_ptr + tok[:, None] * (HC + HC * HC) + HC + ij[None, :], tl.reshape(comb, (BLOCK_T, HC * HC)),
             mask=tok_ok[:, None])
    x_rs = tl.full([BLOCK_T], 1.0, tl.float32)
    if NORM:  # the sublayer's RMSNorm: a first pass for the mean square of x (as stored, rounded)
        x_sq = tl.zeros([BLOCK_T, BLOCK], tl.float32)
        for d0 in range(0, D, BLOCK):
            x = _collapse(h_ptr, pre, tok, i, d0, D, K, tok_ok, BLOCK).to(x_ptr.dtype.element_ty).to(tl.float32)
            x_sq += x * x
        x_rs = 1.0 / tl.sqrt(tl.sum(x_sq, axis=1) / D + norm_eps)
    for d0 in range(0, D, BLOCK):
        offs = d0 + tl.arange(0, BLOCK)
        x = _collapse(h_ptr, pre, tok, i, d0, D, K, tok_ok, BLOCK)
        if NORM:
            w = tl.load(norm_w_ptr + offs, mask=offs < D, other=0.0).to(tl.float32)
            x = w[None, :] * (x.to(x_ptr.dtype.element_ty).to(tl.float32) * x_rs[:, None])
        tl.store(x_ptr + tok[:, None] * D + offs[None, :], x.to(x_ptr.dtype.element_ty),
                 mask=tok_ok[:, None] & (offs < D)[None, :])


@triton.jit
def _collapse(h_ptr, pre, tok, i, d0, D, K, tok_ok, BLOCK: tl.constexpr):
    """Σ_k pre_k h_k over channels d0.. of a token tile → [BT, BLOCK] fp32."""
    offs = d0 + tl.arange(0, BLOCK)
    live = tok_ok[:, None, None] & (offs < D)[None, None, :]
    hv = tl.load(h_ptr + tok[:, None, None] * K + i[None, :, None] * D + offs[None, None, :], mask=live,
                 other=0.0).to(tl.float32)  # [BT, HC, BD]
    return tl.sum(pre[:, :, None] * hv, axis=1)


@triton.jit
def _mhc_post_kernel(h_ptr, y_ptr, post_ptr, comb_ptr, out_ptr, T, D, post_stride, comb_stride, HC: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK: tl.constexpr):
    tok = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    i = tl.arange(0, HC)
    live = (tok < T)[:, None, None] & (offs < D)[None, None, :]
    at = tok[:, None, None] * HC * D + i[None, :, None] * D + offs[None, None, :]
    y = tl.load(y_ptr + tok[:, None] * D + offs[None, :], mask=(tok < T)[:, None] & (offs < D)[None, :],
                other=0.0).to(tl.float32)
    post = tl.load(post_ptr + tok[:, None] * post_stride + i[None, :], mask=(tok < T)[:, None],
                   other=0.0)  # [BT, k]
    mixed = post[:, :, None] * y[:, None, :]
    for j in tl.static_range(HC):  # Σ_j comb[j, k] h_j, one stream at a time keeps it 3-D
        c_j = tl.load(comb_ptr + tok[:, None] * comb_stride + j * HC + i[None, :], mask=(tok < T)[:, None],
                      other=0.0)
        h_j = tl.load(h_ptr + tok[:, None] * HC * D + j * D + offs[None, :],
                      mask=(tok < T)[:, None] & (offs < D)[None, :], other=0.0).to(tl.float32)
        mixed += c_j[:, :, None] * h_j[:, None, :]
    tl.store(out_ptr + at, mixed.to(out_ptr.dtype.element_ty), mask=live)


def _check_streams(hc: int) -> None:
    if hc & (hc - 1):
        raise ValueError(f"the Triton mHC kernels need a power-of-two stream count, got hc_mult={hc}")


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, iters: int, norm_weight: torch.Tensor | None = None
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    t, hc, d = h.shape
    _check_streams(hc)
    # Interpreted, each op costs the same whatever its size: fewer, larger tiles run faster.
    # On a GPU: two-token tiles, the mixing over 64 slices of K and the collapse over 1K-wide column
    # tiles keep a decode step's two launches to a few loop trips each (latency, not bandwidth, bounds them).
    block_t, block, splits, block_d, warps = (16, 128, 1, 128, 4) if interpreting() else (2, 128, MIX_SPLITS, 1024, 8)
    rows, k = 2 * hc + hc * hc, hc * d
    width = triton.next_power_of_2(rows + 1)
    x = h.new_empty(t, d)
    # The gates and the mixing's partial sums in one allocation (one op less per call in an eager step).
    scratch = h.new_empty(t * (hc + hc * hc) + splits * t * width, dtype=torch.float32)
    gates = scratch[:t * (hc + hc * hc)].view(t, hc + hc * hc)
    part = scratch[t * (hc + hc * hc):].view(splits, t, width)
    if t:
        per_split = triton.cdiv(triton.cdiv(k, splits), block) * block
        h = h.contiguous()
        launch(_mhc_mix_kernel, (triton.cdiv(t, block_t), splits), h, fn.contiguous(), part, t, k, per_split,
               R=rows, RP=width, BLOCK_T=block_t, BLOCK=block, num_warps=warps)
        launch(_mhc_pre_kernel, (triton.cdiv(t, block_t),),
               h, part, base.float().contiguous(), scale.float().contiguous(),
               norm_weight if norm_weight is not None else base, x, gates, t, d, hc_eps, norm_eps, HC=hc,
               RP=width, SPLITS=splits, ITERS=iters, NORM=norm_weight is not None, BLOCK_T=block_t,
               BLOCK=block_d, num_warps=warps)
    return x, gates[:, :hc], gates[:, hc:].view(t, hc, hc)


def mhc_post(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    t, hc, d = h.shape
    _check_streams(hc)
    out = torch.empty_like(h)
    # post and comb may be views of mhc_pre's one gates buffer: rows at any stride, packed within.
    if post.stride(-1) != 1:
        post = post.contiguous()
    if comb.stride(-1) != 1 or comb.stride(-2) != hc:
        comb = comb.contiguous()
    if t:
        block_t, block = (16, 256) if interpreting() else (4, 128)
        launch(_mhc_post_kernel, (triton.cdiv(t, block_t), triton.cdiv(d, block)),
               h.contiguous(), y.contiguous(), post, comb, out, t, d, post.stride(0), comb.stride(0), HC=hc,
               BLOCK_T=block_t, BLOCK=block)
    return out
