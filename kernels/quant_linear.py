"""Linear layers computed from weights kept in checkpoint precision (plain torch, the twin of
`quant_linear_triton.py`).

DeepSeek-V4 checkpoints hold most projections as FP8 e4m3 with one scale per 128×128 block and the
routed experts as FP4 e2m1, two codes per byte along the input dimension (low nibble = even
element), with one scale per 32 inputs of a row. A `QuantizedWeight` keeps those codes and scales
as loaded; `linear(x, w)` computes `x @ dequant(w)ᵀ` from a transient dequantized copy, one tile of
output rows at a time past `_TILE_ELEMENTS` (no V4 projection is that large; see there).

Resident weights hold no floating-point tensor, so casting a model (`model.to(torch.bfloat16)`) can
never round them: codes are bytes (FP8 codes viewed as uint8) and scales are raw e8m0 bytes (uint8,
value 2^(byte − 127), what the official checkpoints store) or the bits of fp32 scales (int32).
Float tensors are accepted too (tests, freshly quantized weights).

Shapes: T = tokens, N = output features, K = input features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8_BLOCK = 128  # FP8 weights: one scale per FP8_BLOCK × FP8_BLOCK tile
FP4_GROUP = 32  # FP4 weights: one scale per FP4_GROUP consecutive inputs of a row
FORMATS = ("fp8", "fp4")

# A dequantized tile holds at most this many elements (512 MiB in fp32). Every packed projection of
# V4-Flash and V4-Pro fits whole (the largest, Pro's wo_b, is 117 M values): one GEMM over the whole
# weight, as a dequantized model runs it, because splitting a GEMM by output rows changes its
# rounding once T is large (MKL, 2,300 rows: 1.5e-4 apart), and `--weight-dtype checkpoint` must
# give the logits `fp32` gives. Tiles bound the transient copy only for larger weights.
_TILE_ELEMENTS = 1 << 27

# Value of each 4-bit e2m1 code: bit 3 sign, bits 2..1 exponent (bias 1), bit 0 mantissa.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


@dataclass(frozen=True)
class QuantizedWeight:
    """A weight [..., N, K] kept packed: `codes` (fp8: e4m3 bytes [..., N, K], as uint8 or
    float8_e4m3fn; fp4: two e2m1 codes per byte [..., N, K/2], uint8 or int8) and `scale` (fp8:
    [..., ⌈N/128⌉, ⌈K/128⌉]; fp4: [..., N, ⌈K/32⌉]; see `scale_values`). Leading dims index a
    stack of experts: `w[e]` is expert e's weight."""

    codes: torch.Tensor
    scale: torch.Tensor
    fmt: str

    @property
    def shape(self) -> tuple[int, ...]:
        *lead, n, k = self.codes.shape
        return (*lead, n, 2 * k if self.fmt == "fp4" else k)

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def __getitem__(self, index: int) -> QuantizedWeight:
        return QuantizedWeight(self.codes[index], self.scale[index], self.fmt)

    def dequantize(self, dtype: torch.dtype = torch.float32, rows: slice | None = None) -> torch.Tensor:
        """Rows [a, b) (default all) of a 2-D weight as `dtype` [b − a, K]."""
        n = self.codes.shape[-2]
        a, b, _ = (rows or slice(None)).indices(n)
        if self.fmt == "fp8":
            return _dequant_fp8_rows(self.codes, self.scale, a, b, dtype)
        return _dequant_fp4_rows(self.codes, self.scale, a, b, dtype)


Weight = torch.Tensor | QuantizedWeight


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: raw e8m0 bytes (uint8) decode to 2^(byte − 127), int32 holds fp32 bits,
    floats are cast."""
    if scale.dtype == torch.uint8:
        exponent = scale.to(torch.int32) - 127
        return torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
    if scale.dtype == torch.int32:
        return scale.view(torch.float32)
    return scale.float()


def _dequant_fp8_rows(codes: torch.Tensor, scale: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    k = codes.shape[-1]
    s = scale_values(scale[a // FP8_BLOCK:-(-b // FP8_BLOCK)])  # the block rows that rows [a, b) touch
    s = s.repeat_interleave(FP8_BLOCK, 0)[a % FP8_BLOCK:a % FP8_BLOCK + b - a]
    s = s.repeat_interleave(FP8_BLOCK, 1)[:, :k]
    return (codes[a:b].view(torch.float8_e4m3fn).float() * s).to(dtype)


def _dequant_fp4_rows(codes: torch.Tensor, scale: torch.Tensor, a: int, b: int, dtype: torch.dtype) -> torch.Tensor:
    k = 2 * codes.shape[-1]
    pairs = _e2m1_pairs(codes.device)[codes[a:b].view(torch.uint8).long()]  # [rows, K/2, 2]
    values = pairs.flatten(-2)
    s = scale_values(scale[a:b]).repeat_interleave(FP4_GROUP, -1)[:, :k]
    return (values * s).to(dtype)


_PAIR_TABLES: dict[torch.device, torch.Tensor] = {}


def _e2m1_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2]: the (even, odd) values of each byte; one lookup per byte unpacks both nibbles."""
    table = _PAIR_TABLES.get(device)
    if table is None:
        values = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=device)
        byte = torch.arange(256, device=device)
        table = _PAIR_TABLES[device] = torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)
    return table


def tile_rows(w: QuantizedWeight) -> int:
    """Output rows per dequantized tile: whole scale blocks, at most `_TILE_ELEMENTS` values."""
    n, k = w.shape[-2:]
    step = FP8_BLOCK if w.fmt == "fp8" else 1
    rows = max(step, (_TILE_ELEMENTS // max(k, 1)) // step * step)
    return min(rows, n)


def quant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [T, K] @ dequant(w)ᵀ → [T, N] in x's dtype, one tile of output rows at a time."""
    n = w.shape[-2]
    rows = tile_rows(w)
    if rows >= n:
        return F.linear(x, w.dequantize(x.dtype))
    out = x.new_empty(x.shape[0], n)
    for a in range(0, n, rows):
        b = min(a + rows, n)
        out[:, a:b] = F.linear(x, w.dequantize(x.dtype, slice(a, b)))
    return out


def linear(x: torch.Tensor, weight: Weight) -> torch.Tensor:
    """x [T, K], weight [N, K] (a tensor or a `QuantizedWeight`) → [T, N]."""
    if isinstance(weight, QuantizedWeight):
        return quant_linear(x, weight)
    return F.linear(x, weight)


def grouped_quant_linear(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """x [T, G, K] with w [G·O, K] packed (the grouped output projection `wo_a`): group g of every
    row through rows [g·O, (g+1)·O) of w → [T, G, O], one group's rows dequantized at a time."""
    groups = x.shape[1]
    rows = w.shape[-2] // groups
    out = x.new_empty(x.shape[0], groups, rows)
    for g in range(groups):
        out[:, g] = F.linear(x[:, g], w.dequantize(x.dtype, slice(g * rows, (g + 1) * rows)))
    return out
