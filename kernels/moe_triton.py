"""Triton kernels for the mixture of experts: the twins of `moe.route` and `moe.experts` (same
signatures; see `moe.py` for the semantics).

`route` is one program per token (several when interpreted): scores, the top-k by repeated max
(ties go to the lower expert), weights renormalised and scaled, shared experts appended. `experts`
sorts the (token, expert) pairs by expert and runs two grouped GEMM launches — gate/up projections
with the SwiGLU, then the down projection times the pair's weight — one program per (expert,
output tile), each walking its expert's pairs in tiles, so every expert's weights are read once
per tile of its tokens. Each pair's result lands in its own row; a token's terms are then summed
in choice order, never with atomics, so a token's output does not depend on its batch-mates.

Packed expert stacks (`QuantizedWeight`, FP8 or FP4, as the checkpoints hold them) run the same
grouped structure through their own pair of kernels, whose inner loop is `quant_linear_triton`'s
`packed_dot`: each weight tile is decoded from its codes and scales in registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.launches import interpreting, launch
from v4serve.kernels.moe import SCORE_FUNCS
from v4serve.kernels.quant_linear import QuantizedWeight
from v4serve.kernels.quant_linear_triton import kernel_operands, packed_dot, precision_of, upcast

NEG_INF = tl.constexpr(float("-inf"))


@triton.jit
def _route_kernel(logits_ptr, bias_ptr, hashed_ptr, weights_ptr, chosen_ptr, n, E, scale, K: tl.constexpr,
                  S: tl.constexpr, FUNC: tl.constexpr, HASHED: tl.constexpr, BLOCK_T: tl.constexpr,
                  BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    # BLOCK_T tokens [T] a program, each reduced along its own row only.
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = (t < n)[:, None]
    e = tl.arange(0, BLOCK_E)[None, :]
    live = e < E
    # Rows past n read zeros (all −inf would make NaNs in their softmax; they are never stored).
    logit = tl.load(logits_ptr + t[:, None] * E + e, mask=row_ok & live, other=0.0).to(tl.float32)  # [T, E]
    logit = tl.where(live, logit, NEG_INF)
    if FUNC == 0:  # softmax
        z = tl.exp(logit - tl.max(logit, axis=1)[:, None])
        scores = z / tl.sum(z, axis=1)[:, None]
    elif FUNC == 1:  # sigmoid
        scores = tl.sigmoid(logit)
    else:  # sqrt(softplus): max(x, 0) + log1p(e^−|x|), linear above 20 as torch's
        z = tl.exp(-tl.abs(logit))
        # log(1 + z) loses z's low bits (all of them below fp32's epsilon: very negative logits
        # would score 0). log(u)·z/(u − 1) with u = 1 + z corrects for the rounding of u.
        u = 1.0 + z
        log1p = tl.where(u == 1.0, z, tl.log(u) * z / tl.where(u == 1.0, 1.0, u - 1.0))
        scores = tl.sqrt(tl.where(logit > 20.0, logit, tl.maximum(logit, 0.0) + log1p))
    scores = tl.where(live, scores, 0.0)
    j = tl.arange(0, BLOCK_K)[None, :]
    picked = tl.zeros([BLOCK_T, BLOCK_K], tl.int64)
    picked_w = tl.zeros([BLOCK_T, BLOCK_K], tl.float32)
    if HASHED:
        picked = tl.load(hashed_ptr + t[:, None] * K + j, mask=row_ok & (j < K), other=0).to(tl.int64)
        for k in tl.static_range(K):
            idx = tl.sum(tl.where(j == k, picked, 0), axis=1)[:, None]
            picked_w = tl.where(j == k, tl.sum(tl.where(e == idx, scores, 0.0), axis=1)[:, None], picked_w)
    else:
        sel = tl.where(live, scores + tl.load(bias_ptr + e, mask=live, other=0.0).to(tl.float32), NEG_INF)
        for k in tl.static_range(K):
            best = tl.max(sel, axis=1)[:, None]
            idx = tl.min(tl.where(sel == best, e, BLOCK_E), axis=1)[:, None]
            picked = tl.where(j == k, idx.to(tl.int64), picked)
            picked_w = tl.where(j == k, tl.sum(tl.where(e == idx, scores, 0.0), axis=1)[:, None], picked_w)
            sel = tl.where(e == idx, NEG_INF, sel)
    picked_w = picked_w / (tl.sum(tl.where(j < K, picked_w, 0.0), axis=1)[:, None] + 1e-20) * scale
    row = t[:, None] * (K + S)
    tl.store(weights_ptr + row + j, picked_w, mask=row_ok & (j < K))
    tl.store(chosen_ptr + row + j, picked, mask=row_ok & (j < K))
    tl.store(weights_ptr + row + K + j, tl.full([BLOCK_T, BLOCK_K], 1.0, tl.float32), mask=row_ok & (j < S))
    tl.store(chosen_ptr + row + K + j, E + j.to(tl.int64) + tl.zeros([BLOCK_T, BLOCK_K], tl.int64),
             mask=row_ok & (j < S))


def route(logits: torch.Tensor, bias: torch.Tensor | None, hashed: torch.Tensor | None, func: str, topk: int,
          scale: float, num_shared: int) -> tuple[torch.Tensor, torch.Tensor]:
    n, e = logits.shape
    weights = torch.empty(n, topk + num_shared, dtype=torch.float32, device=logits.device)
    chosen = torch.empty(n, topk + num_shared, dtype=torch.long, device=logits.device)
    if n == 0:
        return weights, chosen
    # One token a program on a GPU; the interpreter pays per op, not per element, so it takes many.
    block_t = 16 if interpreting() else 1
    launch(_route_kernel, (triton.cdiv(n, block_t),), logits.contiguous(), bias if bias is not None else logits,
           hashed.contiguous() if hashed is not None else chosen, weights, chosen, n, e, scale,
           K=topk, S=num_shared, FUNC=SCORE_FUNCS.index(func), HASHED=hashed is not None, BLOCK_T=block_t,
           BLOCK_E=triton.next_power_of_2(e), BLOCK_K=triton.next_power_of_2(max(topk, num_shared)))
    return weights, chosen


@triton.jit
def _expert_tile(ends_ptr, n_cols, BLOCK_N: tl.constexpr):
    """This program's expert, its output columns (and which exist), and the span [start, end) of
    the expert's pairs in sorted order."""
    e = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    end = tl.load(ends_ptr + e)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0)
    return e, cols, cols < n_cols, start, end


@triton.jit
def _pairs_of(order_ptr, m0, end, BLOCK_M: tl.constexpr):
    """Tile m0.. of an expert's pairs (sorted by expert): their pair ids and which are real."""
    idx = m0 + tl.arange(0, BLOCK_M)
    ok = idx < end
    return tl.load(order_ptr + idx, mask=ok, other=0), ok


@triton.jit
def _store_swiglu(gate, up, limit, h_ptr, pair, ok, cols, col_ok, INTER, HAS_LIMIT: tl.constexpr):
    """The up kernels' epilogue: h = silu(clamped gate) · clamped up, into each pair's row."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    h = gate * tl.sigmoid(gate) * up
    tl.store(h_ptr + pair[:, None] * INTER + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _store_weighted(acc, weights_ptr, y_ptr, pair, ok, cols, col_ok, D):
    """The down kernels' epilogue: each pair's row times its routing weight."""
    acc = acc * tl.load(weights_ptr + pair, mask=ok, other=0.0)[:, None]
    tl.store(y_ptr + pair[:, None] * D + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=ok[:, None] & col_ok[None, :])


@triton.jit
def _up_kernel(x_ptr, w1_ptr, w3_ptr, order_ptr, ends_ptr, h_ptr, D, INTER, limit, KS: tl.constexpr,
               HAS_LIMIT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr):
    e, cols, col_ok, start, end = _expert_tile(ends_ptr, INTER, BLOCK_N)
    for m0 in range(start, end, BLOCK_M):
        pair, ok = _pairs_of(order_ptr, m0, end, BLOCK_M)
        tok = pair // KS
        gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, D, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < D
            xk = tl.load(x_ptr + tok[:, None] * D + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w_at = e * INTER * D + cols[:, None] * D + k[None, :]
            w_ok = col_ok[:, None] & k_ok[None, :]
            gate += tl.dot(xk, tl.trans(tl.load(w1_ptr + w_at, mask=w_ok, other=0.0)), input_precision=PRECISION)
            up += tl.dot(xk, tl.trans(tl.load(w3_ptr + w_at, mask=w_ok, other=0.0)), input_precision=PRECISION)
        _store_swiglu(gate, up, limit, h_ptr, pair, ok, cols, col_ok, INTER, HAS_LIMIT)


@triton.jit
def _down_kernel(h_ptr, w2_ptr, weights_ptr, order_ptr, ends_ptr, y_ptr, D, INTER, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr):
    e, cols, col_ok, start, end = _expert_tile(ends_ptr, D, BLOCK_N)
    for m0 in range(start, end, BLOCK_M):
        pair, ok = _pairs_of(order_ptr, m0, end, BLOCK_M)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            k = k0 + tl.arange(0, BLOCK_K)
            k_ok = k < INTER
            hk = tl.load(h_ptr + pair[:, None] * INTER + k[None, :], mask=ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w2_ptr + e * D * INTER + cols[:, None] * INTER + k[None, :],
                        mask=col_ok[:, None] & k_ok[None, :], other=0.0)
            acc += tl.dot(hk, tl.trans(w), input_precision=PRECISION)
        _store_weighted(acc, weights_ptr, y_ptr, pair, ok, cols, col_ok, D)


@triton.jit
def _packed_up_kernel(x_ptr, w1_codes, w1_scale, w3_codes, w3_scale, codes_stride, scale_stride, order_ptr, ends_ptr,
                      h_ptr, D, INTER, limit, KS: tl.constexpr, HAS_LIMIT: tl.constexpr, FP4: tl.constexpr,
                      E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`_up_kernel` over packed stacks: expert e's codes and scales start e strides in."""
    e, cols, col_ok, start, end = _expert_tile(ends_ptr, INTER, BLOCK_N)
    codes_at, scale_at = e * codes_stride, e * scale_stride
    for m0 in range(start, end, BLOCK_M):
        pair, ok = _pairs_of(order_ptr, m0, end, BLOCK_M)
        tok = pair // KS
        gate = packed_dot(x_ptr, tok, ok, D, w1_codes + codes_at, w1_scale + scale_at, cols, col_ok, D, FP4, E8M0,
                          BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
        up = packed_dot(x_ptr, tok, ok, D, w3_codes + codes_at, w3_scale + scale_at, cols, col_ok, D, FP4, E8M0,
                        BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
        _store_swiglu(gate, up, limit, h_ptr, pair, ok, cols, col_ok, INTER, HAS_LIMIT)


@triton.jit
def _packed_down_kernel(h_ptr, w2_codes, w2_scale, codes_stride, scale_stride, weights_ptr, order_ptr, ends_ptr, y_ptr,
                        D, INTER, FP4: tl.constexpr, E8M0: tl.constexpr, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """`_down_kernel` over a packed stack."""
    e, cols, col_ok, start, end = _expert_tile(ends_ptr, D, BLOCK_N)
    codes_at, scale_at = e * codes_stride, e * scale_stride
    for m0 in range(start, end, BLOCK_M):
        pair, ok = _pairs_of(order_ptr, m0, end, BLOCK_M)
        acc = packed_dot(h_ptr, pair, ok, INTER, w2_codes + codes_at, w2_scale + scale_at, cols, col_ok, INTER, FP4,
                         E8M0, BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
        _store_weighted(acc, weights_ptr, y_ptr, pair, ok, cols, col_ok, D)


Stack = torch.Tensor | QuantizedWeight


def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, w1: Stack, w2: Stack, w3: Stack,
            limit: float, remote: bool = False) -> torch.Tensor:
    """Dense stacks or packed ones (`QuantizedWeight` [E+S, I, D] etc., FP8 or FP4: their tiles are
    decoded in the kernels, never the whole stack); all three alike. `remote`: choices equal to the
    stack's length (other ranks' experts) sort after every real pair, no program runs them, and
    their rows of y are zeros."""
    t, d = x.shape
    if t == 0:
        return torch.zeros_like(x)
    packed = [isinstance(w, QuantizedWeight) for w in (w1, w2, w3)]
    if any(packed) and not all(packed):
        raise TypeError("experts: w1, w2 and w3 must all be packed or all be dense")
    ks, groups, inter = chosen.shape[1], w1.shape[0], w1.shape[1]
    flat = chosen.flatten()
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, in token order within each
    # Pairs per expert, counted at a fixed size (bincount sizes its output by the largest id, which a
    # GPU must read back: a host sync); remote pairs (id == groups) land in the extra last count.
    counts = torch.zeros(groups + 1, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    ends = torch.cumsum(counts[:groups], 0)
    rows = torch.empty(t * ks * (inter + d), dtype=x.dtype, device=x.device)  # one allocation for both
    if remote:
        rows[t * ks * inter:].zero_()  # the skipped pairs' results: summed below, so they must be zero
    h, y = rows[:t * ks * inter].view(t * ks, inter), rows[t * ks * inter:].view(t * ks, d)
    run = _packed_launches if all(packed) else _dense_launches
    run(x.contiguous(), weights.contiguous().flatten(), order, ends, h, y, w1, w2, w3, limit, ks)
    return y.view(t, ks, d).sum(dim=1)


def _dense_launches(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, ends: torch.Tensor, h: torch.Tensor,
                    y: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, w3: torch.Tensor, limit: float,
                    ks: int) -> None:
    groups, inter, d = w1.shape
    big = interpreting()  # the interpreter pays per op, not per element: fewer, larger tiles
    block_m, block_k = 16, 64 if not big else 256
    precision = precision_of(x)
    block_n = min(triton.next_power_of_2(inter), 64 if not big else 256)
    launch(_up_kernel, (groups, triton.cdiv(inter, block_n)),
           x, w1, w3, order, ends, h, d, inter, float(limit), KS=ks, HAS_LIMIT=bool(limit), BLOCK_M=block_m,
           BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision)
    block_n = min(triton.next_power_of_2(d), 64 if not big else 256)
    launch(_down_kernel, (groups, triton.cdiv(d, block_n)),
           h, w2, weights, order, ends, y, d, inter, BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=block_k, PRECISION=precision)


def _packed_launches(x: torch.Tensor, weights: torch.Tensor, order: torch.Tensor, ends: torch.Tensor,
                     h: torch.Tensor, y: torch.Tensor, w1: QuantizedWeight, w2: QuantizedWeight, w3: QuantizedWeight,
                     limit: float, ks: int) -> None:
    groups, inter, d = w1.shape
    c1, s1, fp4, e8m0 = kernel_operands(w1)
    c3, s3, fp4_3, e8m0_3 = kernel_operands(w3)
    c2, s2, fp4_2, e8m0_2 = kernel_operands(w2)
    if (fp4, e8m0, s1.dtype) != (fp4_3, e8m0_3, s3.dtype):
        raise ValueError("experts: w1 and w3 must be packed alike (one up kernel reads both)")
    big = interpreting()
    # BLOCK_K 128 at most: an FP8 K tile must lie inside one 128-wide scale block.
    block_m, block_k = 16, 64 if not big else 128
    common = dict(BLOCK_M=block_m, BLOCK_K=block_k, PRECISION=precision_of(x), UPCAST=upcast(x))
    block_n = max(16, min(triton.next_power_of_2(inter), 64 if not big else 256))  # a GPU dot needs N ≥ 16
    launch(_packed_up_kernel, (groups, triton.cdiv(inter, block_n)),
           x, c1, s1, c3, s3, c1.stride(0), s1.stride(0), order, ends, h, d, inter, float(limit), KS=ks,
           HAS_LIMIT=bool(limit), FP4=fp4, E8M0=e8m0, BLOCK_N=block_n, **common)
    block_n = max(16, min(triton.next_power_of_2(d), 64 if not big else 256))
    launch(_packed_down_kernel, (groups, triton.cdiv(d, block_n)),
           h, c2, s2, c2.stride(0), s2.stride(0), weights, order, ends, y, d, inter, FP4=fp4_2, E8M0=e8m0_2,
           BLOCK_N=block_n, **common)
