"""Block-scaled FP8 and packed FP4 weights: dequantization at load time, plus quantizers.

DeepSeek-V4 checkpoints store most linear weights as FP8 e4m3 with one scale per 128x128 block
(scale grid `[ceil(N/128), ceil(K/128)]`) and the routed experts as FP4 e2m1, two codes per byte
along the input dimension (low nibble = even element, high nibble = odd element) with one scale per
32 consecutive logical elements of a row (scale grid `[N, ceil(K/32)]`). Scales are either fp32 or
`float8_e8m0fnu` (a bare power-of-two exponent, value `2 ** (byte - 127)`, 0xFF is NaN). The stored
scale is a multiplier: `real = code_value * scale`.

The quantizers exist so tests and `make-checkpoint` can write checkpoints in the real format.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

FP8_BLOCK: tuple[int, int] = (128, 128)
FP4_GROUP: int = 32
FP8_E4M3_MAX: float = 448.0
FP4_E2M1_MAX: float = 6.0

# Value of each 4-bit e2m1 code: bit 3 is the sign, bits 2..1 the exponent (bias 1), bit 0 the
# mantissa; code 8 is negative zero.
FP4_E2M1_VALUES: tuple[float, ...] = (
    0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
    -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0,
)  # fmt: skip

_E8M0 = getattr(torch, "float8_e8m0fnu", None)
_FP4X2 = getattr(torch, "float4_e2m1fn_x2", None)
FP8_WEIGHT_DTYPES: frozenset[torch.dtype] = frozenset({torch.float8_e4m3fn, torch.float8_e5m2})
FP4_PACKED_DTYPES: frozenset[torch.dtype] = frozenset(
    {torch.int8, torch.uint8} | ({_FP4X2} if _FP4X2 is not None else set())
)


def fp8_scale_shape(
    shape: tuple[int, ...] | torch.Size, block: tuple[int, int] = FP8_BLOCK
) -> tuple[int, ...]:
    """Scale grid for an FP8 weight of `shape` (leading dims are batch dims, e.g. experts)."""
    *lead, n, k = shape
    return (*lead, math.ceil(n / block[0]), math.ceil(k / block[1]))


def fp4_scale_shape(logical_shape: tuple[int, ...] | torch.Size, group: int = FP4_GROUP) -> tuple[int, ...]:
    """Scale grid for an FP4 weight whose unpacked shape is `logical_shape`."""
    *lead, k = logical_shape
    return (*lead, math.ceil(k / group))


def scale_to_float32(scale: torch.Tensor) -> torch.Tensor:
    """fp32 view of a scale tensor stored as fp32/bf16/fp16, `float8_e8m0fnu` or raw e8m0 bytes."""
    if scale.dtype == torch.uint8:
        # Raw e8m0 bytes (some writers store the exponent byte without the float8 dtype).
        exponent = scale.to(torch.int32) - 127
        out = torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent)
        return out.masked_fill_(scale == 0xFF, float("nan"))
    if not scale.dtype.is_floating_point:
        raise ValueError(f"scale tensor has dtype {scale.dtype}; expected a float or e8m0 dtype")
    # Casting e8m0 to fp32 is exact: every e8m0 value is a power of two within fp32's range.
    return scale.to(torch.float32)


def _apply_block_scale(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """Multiply fp32 `values` [..., N, K] by one scale per (block[0] x block[1]) tile, in place
    when the shape is a whole number of tiles (the common case, so no second full-size buffer)."""
    *lead, n, k = values.shape
    br, bc = block
    pad_n, pad_k = -n % br, -k % bc
    if pad_n or pad_k:
        values = F.pad(values, (0, pad_k, 0, pad_n))
    gr, gc = (n + pad_n) // br, (k + pad_k) // bc
    tiles = values.view(*lead, gr, br, gc, bc)
    tiles.mul_(scale.reshape(*lead, gr, 1, gc, 1))
    out = tiles.view(*lead, gr * br, gc * bc)
    return out[..., :n, :k].contiguous() if (pad_n or pad_k) else out


def _check_scale(kind: str, scale: torch.Tensor, want: tuple[int, ...], weight_shape: torch.Size) -> None:
    if tuple(scale.shape) != want:
        raise ValueError(
            f"{kind} scale has shape {tuple(scale.shape)} but a weight of shape {tuple(weight_shape)} "
            f"needs {want}"
        )


def dequant_fp8_block(
    weight_fp8: torch.Tensor,
    scale: torch.Tensor,
    block: tuple[int, int] = FP8_BLOCK,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP8 weight [..., N, K] with a scale per `block` tile ([..., ceil(N/br), ceil(K/bc)]) -> `dtype`."""
    if weight_fp8.dtype not in FP8_WEIGHT_DTYPES:
        raise ValueError(f"FP8 weight has dtype {weight_fp8.dtype}; expected float8_e4m3fn")
    if weight_fp8.dim() < 2:
        raise ValueError(f"FP8 weight must be at least 2-D, got shape {tuple(weight_fp8.shape)}")
    _check_scale("FP8", scale, fp8_scale_shape(weight_fp8.shape, block), weight_fp8.shape)
    out = _apply_block_scale(weight_fp8.to(torch.float32), scale_to_float32(scale), block)
    return out.to(dtype)


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 codes [..., K/2] (int8, uint8 or float4_e2m1fn_x2) -> fp32 values [..., K]."""
    if packed.dtype not in FP4_PACKED_DTYPES:
        raise ValueError(f"packed FP4 weight has dtype {packed.dtype}; expected int8 or uint8")
    codes = packed.contiguous().view(torch.uint8)
    # One lookup per byte into a 256-entry (even, odd) table halves the index traffic of
    # unpacking nibbles separately.
    pairs = _fp4_pair_table(packed.device)[codes.long()]
    return pairs.flatten(-2)


def _fp4_pair_table(device: torch.device) -> torch.Tensor:
    values = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    byte = torch.arange(256, device=device)
    return torch.stack((values[byte & 0x0F], values[byte >> 4]), dim=-1)


def dequant_fp4_packed(
    packed_int8: torch.Tensor,
    scale: torch.Tensor,
    group: int = FP4_GROUP,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """FP4 weight packed two per byte along the last dim ([..., N, K/2]) with one scale per `group`
    logical elements ([..., N, ceil(K/group)]) -> `dtype` [..., N, K]."""
    values = unpack_fp4(packed_int8)
    _check_scale("FP4", scale, fp4_scale_shape(values.shape, group), packed_int8.shape)
    *lead, k = values.shape
    out = _apply_block_scale(
        values.view(-1, 1, k), scale_to_float32(scale).reshape(-1, 1, scale.shape[-1]), (1, group)
    )
    return out.view(*lead, k).to(dtype)


def _pow2_scale(amax: torch.Tensor, qmax: float) -> torch.Tensor:
    """Smallest power of two s with amax / s <= qmax (what an e8m0 scale can hold exactly)."""
    return torch.exp2(torch.ceil(torch.log2(amax / qmax)))


def _block_amax(weight: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    *lead, n, k = weight.shape
    br, bc = block
    padded = F.pad(weight.abs().float(), (0, -k % bc, 0, -n % br))
    gr, gc = padded.shape[-2] // br, padded.shape[-1] // bc
    return padded.view(*lead, gr, br, gc, bc).amax(dim=(-3, -1))


def _make_scale(
    amax: torch.Tensor, qmax: float, scale_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale as stored, the fp32 value it decodes to), never zero so all-zero blocks stay finite."""
    amax = amax.clamp_min(torch.finfo(torch.float32).tiny * qmax)
    if scale_dtype == _E8M0:
        s = _pow2_scale(amax, qmax)
        return s.to(scale_dtype), s
    s = (amax / qmax).to(scale_dtype)
    return s, s.to(torch.float32)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = FP8_BLOCK, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] -> (float8_e4m3fn [..., N, K], scale [..., ceil(N/br), ceil(K/bc)])."""
    stored, s = _make_scale(_block_amax(weight, block), FP8_E4M3_MAX, scale_dtype)
    *lead, n, k = weight.shape
    inv = (1.0 / s).repeat_interleave(block[0], -2)[..., :n, :].repeat_interleave(block[1], -1)[..., :k]
    q = (weight.float() * inv).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    return q, stored


def quantize_fp4_packed(
    weight: torch.Tensor, group: int = FP4_GROUP, scale_dtype: torch.dtype = torch.float32
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N, K] (K even) -> (int8 codes [..., N, K/2], scale [..., N, ceil(K/group)])."""
    *lead, n, k = weight.shape
    if k % 2:
        raise ValueError(f"FP4 packing needs an even last dimension, got {k}")
    stored, s = _make_scale(_block_amax(weight, (1, group)), FP4_E2M1_MAX, scale_dtype)
    scaled = weight.float() / s.repeat_interleave(group, -1)[..., :k]
    magnitudes = torch.tensor(FP4_E2M1_VALUES[:8], dtype=torch.float32, device=weight.device)
    codes = (scaled.abs().clamp(max=FP4_E2M1_MAX).unsqueeze(-1) - magnitudes).abs().argmin(-1)
    codes = (codes | (scaled < 0).long() << 3).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.view(torch.int8), stored
