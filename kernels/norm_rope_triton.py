"""Triton RMSNorm / RoPE / both in one launch: the twin of `norm_rope.py` (same signatures).

One program per tile of rows; each row is normalised on its own (a fixed reduction order, whatever
its batch-mates). A rotated column reads its pair partner (column c xor 1) a second time rather than
shuffling registers.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from v4serve.kernels.launches import interpreting, launch


@triton.jit
def _norm_rope_kernel(x_ptr, w_ptr, cos_ptr, sin_ptr, out_ptr, N, D, heads, stride_t, half, eps,
                      NORM: tl.constexpr, HAS_WEIGHT: tl.constexpr, ROPE: tl.constexpr, INVERSE: tl.constexpr,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    live = (rows < N)[:, None] & (cols < D)[None, :]
    # Row r is head r % heads of token r // heads; tokens are stride_t apart (a column slice of a
    # wider projection is read in place).
    at_row = (rows // heads) * stride_t + (rows % heads) * D
    x = tl.load(x_ptr + at_row[:, None] + cols[None, :], mask=live, other=0.0).to(tl.float32)
    rs = tl.full([BLOCK_R], 1.0, tl.float32)
    if NORM:
        rs = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
        x = x * rs[:, None]
        if HAS_WEIGHT:
            x = x * tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)[None, :]
    if ROPE:
        first = D - 2 * half  # first rotated column
        rotated = (cols >= first) & (cols < D)
        pair = tl.maximum(cols - first, 0) // 2
        partner = cols ^ 1
        y = tl.load(x_ptr + at_row[:, None] + partner[None, :], mask=live & rotated[None, :], other=0.0)
        y = y.to(tl.float32)
        if NORM:
            y = y * rs[:, None]
            if HAS_WEIGHT:
                y = y * tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)[None, :]
        at = (rows // heads)[:, None] * half + pair[None, :]
        cos = tl.load(cos_ptr + at, mask=live & rotated[None, :], other=1.0)
        sin = tl.load(sin_ptr + at, mask=live & rotated[None, :], other=0.0)
        if INVERSE:
            sin = -sin
        # even column: x·cos − partner·sin; odd column: x·cos + partner·sin
        sign = tl.where((cols - first) % 2 == 0, -1.0, 1.0)
        x = tl.where(rotated[None, :], x * cos + sign[None, :] * y * sin, x)
    tl.store(out_ptr + rows[:, None] * D + cols[None, :], x.to(out_ptr.dtype.element_ty), mask=live)


def _launch(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor | None,
            sin: torch.Tensor | None, norm: bool, inverse: bool = False, out: torch.Tensor | None = None
            ) -> torch.Tensor:
    if x.dim() == 1:
        return _launch(x[None], weight, eps, cos, sin, norm, inverse)[0]
    d = x.shape[-1]
    n = x.numel() // d if d else 0
    if out is None or not out.is_contiguous() or out.shape != x.shape or out.data_ptr() == x.data_ptr():
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if n == 0:
        return out
    heads = n // x.shape[0]  # rows of one token (its heads), sharing one position's angles
    if not _token_rows(x):
        x = x.contiguous()
    half = cos.shape[-1] if cos is not None else 0
    block_d = triton.next_power_of_2(d)
    block_r = max(1, min(64 if interpreting() else 16, 4096 // block_d))
    dummy = x
    launch(_norm_rope_kernel, (triton.cdiv(n, block_r),),
           x, weight if weight is not None else dummy, cos.contiguous() if cos is not None else dummy,
           sin.contiguous() if sin is not None else dummy, out, n, d, heads, x.stride(0), half, eps,
           NORM=norm, HAS_WEIGHT=weight is not None, ROPE=cos is not None, INVERSE=inverse, BLOCK_R=block_r,
           BLOCK_D=block_d)
    return out


def _token_rows(x: torch.Tensor) -> bool:
    """Whether each token's rows lie packed (heads × D contiguous), tokens at any stride."""
    return x.stride(-1) == 1 and (x.dim() == 2 or (x.dim() == 3 and x.stride(1) == x.shape[2]))


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    return _launch(x, weight, eps, None, None, norm=True)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """`out`: a dead buffer of x's shape to write into (not x itself: a program's partner reads
    could see another program's writes), saving an allocation."""
    return _launch(x, None, 0.0, cos, sin, norm=False, inverse=inverse, out=out)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    return _launch(x, weight, eps, cos, sin, norm=True)
