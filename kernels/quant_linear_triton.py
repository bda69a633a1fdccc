"""Triton linear layers over weights kept in checkpoint precision: the twin of `quant_linear.py`
(same signatures; see it for the formats).

`quant_linear(x, w)` computes `x [T, K] @ dequant(w)ᵀ → [T, N]` straight from the packed codes and
scales, one program per (tile of rows, tile of output features), walking K in a fixed order:

* FP8 (e4m3, one scale per 128×128 block): each 128-wide K block is accumulated in fp32 from the
  codes decoded exactly (every e4m3 value is exact in bf16 and fp16 too), then multiplied by its
  block's scale (one per output feature's row block) and added to the result: the scale is
  applied once per block and output, not once per weight.
* FP4 (e2m1, two codes per byte along K, one scale per 32 inputs of a row): each byte's two codes
  are decoded and scaled in registers (the even code meets the even inputs, the odd code the odd
  ones, so the pair is never interleaved), then multiplied with the activations.

Activations are fp32, bf16 or fp16; products accumulate in fp32; the output has x's dtype.

Batch-invariant by construction: the tile sizes depend on the weight's shape and the device kind,
never on T; a program reduces its K in one fixed order (no split-K), and a row's values never mix
with another row's, so an output row is bitwise the same whatever T is and wherever the row sits in
the batch (an MMA reduces every row of its tile alike; under the interpreter, whose dot is a BLAS
call that may not, each program takes one row). `linear_invariant` relies on this for
`--batch-invariant`.

`packed_dot` is the shared inner loop: the grouped MoE kernels (`moe_triton.py`) call it for packed
expert stacks.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from v4serve.kernels import invariant
from v4serve.kernels import quant_linear as twin
from v4serve.kernels.codes_triton import e2m1, e4m3, e8m0
from v4serve.kernels.launches import interpreting, launch
from v4serve.kernels.quant_linear import FP4_GROUP, FP8_BLOCK, QuantizedWeight, Weight

# The kernels hard-code the formats' block sizes as literals (globals read in a kernel must be
# constexpr); these checks keep the two in step.
assert FP8_BLOCK == 128 and FP4_GROUP == 32

_E8M0 = getattr(torch, "float8_e8m0fnu", None)


@triton.jit
def _scales(raw, E8M0: tl.constexpr):
    """Loaded scales → fp32: e8m0 bytes decoded, fp32 values (the wrapper views int32 bits as
    float32) as they are."""
    if E8M0:
        return e8m0(raw.to(tl.int32))
    else:
        return raw


@triton.jit
def _operand(x, UPCAST: tl.constexpr):
    """Activations as the dot's operand type: their own, or fp32 under the interpreter for bf16,
    whose dot multiplies bf16 tiles as raw integers (it stores them as uint16)."""
    if UPCAST:
        return x.to(tl.float32)
    else:
        return x


@triton.jit
def _fp8_dot(x_ptr, x_rows, x_ok, x_stride, codes_ptr, scale_ptr, cols, col_ok, K, E8M0: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    k_blocks = tl.cdiv(K, 128)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kb in range(0, k_blocks):
        part = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for step in tl.static_range(128 // BLOCK_K):  # BLOCK_K divides the scale block
            k = kb * 128 + step * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = k < K
            xk = _operand(tl.load(x_ptr + x_rows[:, None] * x_stride + k[None, :],
                                  mask=x_ok[:, None] & k_ok[None, :], other=0.0), UPCAST)
            code = tl.load(codes_ptr + cols[:, None] * K + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            part = tl.dot(xk, tl.trans(e4m3(code.to(tl.int32)).to(xk.dtype)), part, input_precision=PRECISION)
        raw = tl.load(scale_ptr + (cols // 128) * k_blocks + kb, mask=col_ok, other=0)
        acc += part * _scales(raw, E8M0)[None, :]
    return acc


@triton.jit
def _fp4_dot(x_ptr, x_rows, x_ok, x_stride, codes_ptr, scale_ptr, cols, col_ok, K, E8M0: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
             UPCAST: tl.constexpr):
    width = K // 2  # bytes per weight row
    groups = tl.cdiv(K, 32)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for b0 in range(0, width, BLOCK_K // 2):
        j = b0 + tl.arange(0, BLOCK_K // 2)  # byte columns: inputs 2j (low nibble) and 2j + 1 (high)
        j_ok = j < width
        w_ok = col_ok[:, None] & j_ok[None, :]
        byte = tl.load(codes_ptr + cols[:, None] * width + j[None, :], mask=w_ok, other=0).to(tl.int32)
        # The tile's BLOCK_K / 32 scales per row, each spread over its 16 bytes (b0 is a multiple of 16).
        g = b0 // 16 + tl.arange(0, BLOCK_K // 32)
        raw = tl.load(scale_ptr + cols[:, None] * groups + g[None, :], mask=col_ok[:, None] & (g < groups)[None, :],
                      other=0)
        s = tl.reshape(tl.broadcast_to(_scales(raw, E8M0)[:, :, None], [BLOCK_N, BLOCK_K // 32, 16]),
                       [BLOCK_N, BLOCK_K // 2])
        x_at = x_ptr + x_rows[:, None] * x_stride + 2 * j[None, :]
        x_mask = x_ok[:, None] & j_ok[None, :]
        x_even = _operand(tl.load(x_at, mask=x_mask, other=0.0), UPCAST)
        x_odd = _operand(tl.load(x_at + 1, mask=x_mask, other=0.0), UPCAST)
        even = (e2m1(byte & 15) * s).to(x_even.dtype)
        odd = (e2m1(byte >> 4) * s).to(x_even.dtype)
        acc = tl.dot(x_even, tl.trans(even), acc, input_precision=PRECISION)
        acc = tl.dot(x_odd, tl.trans(odd), acc, input_precision=PRECISION)
    return acc


@triton.jit
def packed_dot(x_ptr, x_rows, x_ok, x_stride, codes_ptr, scale_ptr, cols, col_ok, K, FP4: tl.constexpr,
               E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """x[x_rows, :K] @ dequant(W[cols, :K])ᵀ → [BLOCK_M, BLOCK_N] fp32, for one packed weight W
    (codes and scales of [N, K] at codes_ptr / scale_ptr, rows contiguous). Rows and columns
    outside x_ok / col_ok come out 0. K is walked in ascending tiles: a fixed order per element.
    FP8 needs BLOCK_K to divide 128, FP4 a multiple of 32. UPCAST: see `upcast`."""
    if FP4:
        acc = _fp4_dot(x_ptr, x_rows, x_ok, x_stride, codes_ptr, scale_ptr, cols, col_ok, K, E8M0, BLOCK_M,
                       BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    else:
        acc = _fp8_dot(x_ptr, x_rows, x_ok, x_stride, codes_ptr, scale_ptr, cols, col_ok, K, E8M0, BLOCK_M,
                       BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    return acc


@triton.jit
def _quant_linear_kernel(x_ptr, codes_ptr, scale_ptr, out_ptr, T, N, K, x_stride, FP4: tl.constexpr,
                         E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < T, cols < N
    acc = packed_dot(x_ptr, rows, row_ok, x_stride, codes_ptr, scale_ptr, cols, col_ok, K, FP4, E8M0, BLOCK_M,
                     BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    tl.store(out_ptr + rows[:, None] * N + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def kernel_operands(w: QuantizedWeight) -> tuple[torch.Tensor, torch.Tensor, bool, bool]:
    """(codes as bytes, scales as uint8 e8m0 bytes or float32, is FP4, scales are e8m0) for the
    kernels; views wherever the stored dtype allows (int32 scales hold fp32 bits)."""
    codes = w.codes.contiguous().view(torch.uint8)
    scale = w.scale.contiguous()
    if scale.dtype == _E8M0:
        scale = scale.view(torch.uint8)
    if scale.dtype == torch.int32:
        scale = scale.view(torch.float32)
    elif scale.dtype != torch.uint8:
        scale = scale.float()
    return codes, scale, w.fmt == "fp4", scale.dtype == torch.uint8


def precision_of(x: torch.Tensor) -> str:
    """fp32 activations are multiplied in full fp32 (tf32 would round them), as the twin does."""
    return "ieee" if x.dtype == torch.float32 else "tf32"


def upcast(x: torch.Tensor) -> bool:
    """Whether bf16 activations must be multiplied as fp32: only under Triton's interpreter, which
    cannot multiply bf16 tiles. Compiled, they meet the decoded weights in bf16 (tensor cores)."""
    return x.dtype == torch.bfloat16 and interpreting()


def tiles(n: int) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K) for a weight of N outputs: never a function of T (batch
    invariance). On a GPU, narrower column tiles for narrow weights keep enough programs busy at
    small T; every row of an MMA tile is reduced alike. The interpreter pays per op, not per
    element (wide column and K tiles), but its dot is a BLAS call whose micro-kernels can round a
    row differently by its place in the tile: there each program takes one row."""
    if interpreting():
        return 1, min(triton.next_power_of_2(n), 128), 128
    block_n = 64
    while block_n > 16 and triton.cdiv(n, block_n) < 256:
        block_n //= 2
    return 64, block_n, 128


def quant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [..., K] @ dequant(w)ᵀ → [..., N] in x's dtype, from the packed codes (one launch)."""
    n, k = w.shape
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    lead = x.shape[:-1]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    t = x2.shape[0]
    out = torch.empty(t, n, dtype=x.dtype, device=x.device)
    if t == 0 or n == 0:
        return out.view(*lead, n)
    codes, scale, fp4, is_e8m0 = kernel_operands(w)
    block_m, block_n, block_k = tiles(n)
    launch(_quant_linear_kernel, (triton.cdiv(t, block_m), triton.cdiv(n, block_n)),
           x2, codes, scale, out, t, n, k, x2.stride(0), FP4=fp4, E8M0=is_e8m0, BLOCK_M=block_m, BLOCK_N=block_n,
           BLOCK_K=block_k, PRECISION=precision_of(x), UPCAST=upcast(x))
    return out.view(*lead, n)


@triton.jit
def _grouped_kernel(x_ptr, codes_ptr, scale_ptr, out_ptr, T, G, R, K, x_stride, FP4: tl.constexpr,
                    E8M0: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    PRECISION: tl.constexpr, UPCAST: tl.constexpr):
    """Group g (program axis 2) of x [T, G, K] through rows [g·R, (g+1)·R) of the packed weight."""
    g = tl.program_id(2).to(tl.int64)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < T, cols < R
    if FP4:
        codes_at, scale_at = codes_ptr + g * R * (K // 2), scale_ptr + g * R * tl.cdiv(K, 32)
    else:  # R is a whole number of 128-row scale blocks (checked by the wrapper)
        codes_at, scale_at = codes_ptr + g * R * K, scale_ptr + g * (R // 128) * tl.cdiv(K, 128)
    acc = packed_dot(x_ptr + g * K, rows, row_ok, x_stride, codes_at, scale_at, cols, col_ok, K, FP4, E8M0,
                     BLOCK_M, BLOCK_N, BLOCK_K, PRECISION, UPCAST)
    tl.store(out_ptr + rows[:, None] * (G * R) + g * R + cols[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & col_ok[None, :])


def grouped_quant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [T, G, K] with w [G·O, K] packed (the grouped output projection `wo_a`) → [T, G, O]: every
    group in one launch. FP8 groups that split a 128-row scale block go through the twin."""
    t, groups, k = x.shape
    rows = w.shape[-2] // groups
    if not _groups_fit(w, groups):
        return twin.grouped_quant_linear(x, w)
    xc = x if x.stride(-1) == 1 and x.stride(1) == k else x.contiguous()
    out = torch.empty(t, groups, rows, dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    codes, scale, fp4, is_e8m0 = kernel_operands(w)
    block_m, block_n, block_k = tiles(rows)
    launch(_grouped_kernel, (triton.cdiv(t, block_m), triton.cdiv(rows, block_n), groups),
           xc, codes, scale, out, t, groups, rows, k, xc.stride(0), FP4=fp4, E8M0=is_e8m0, BLOCK_M=block_m,
           BLOCK_N=block_n, BLOCK_K=block_k, PRECISION=precision_of(x), UPCAST=upcast(x))
    return out


def _groups_fit(w: QuantizedWeight, groups: int) -> bool:
    """Whether each group's rows start on a scale row (always for FP4's per-row scales)."""
    return w.fmt == "fp4" or (w.shape[-2] // groups) % FP8_BLOCK == 0


def grouped_linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, G, I] with weight [G, O, I] dense (one einsum) or [G·O, I] packed (one launch) → [T, G, O]."""
    if isinstance(weight, QuantizedWeight):
        return grouped_quant_linear(x, weight)
    return invariant.grouped_linear(x, weight)


def grouped_linear_invariant(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`grouped_linear` for --batch-invariant: packed weights in the (batch-invariant) kernel, dense
    ones row by row."""
    if isinstance(weight, QuantizedWeight) and _groups_fit(weight, x.shape[1]):
        return grouped_quant_linear(x, weight)
    return invariant.grouped_linear_rows(x, weight)


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, K], weight [N, K] (a tensor or a `QuantizedWeight`) → [T, N]: dense weights through
    `F.linear` (cuBLAS on a GPU), packed ones through the Triton kernel."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight)
    return F.linear(x, weight)


def linear_invariant(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """`linear` for --batch-invariant: the packed kernel is batch-invariant already (one launch for
    the batch); a dense GEMM picks its algorithm by T, so dense weights go row by row."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight)
    return invariant.linear_rows(x, weight)
