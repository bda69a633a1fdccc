"""DeepSeek-V4.1's KV formats, as values: a row rounded exactly as its stored form will read back.

V4.1 keeps its window keys as FP8 e4m3 with one power-of-two (ue8m0) scale per 32 channels, its
compressed entries as NVFP4 (e2m1 codes, one e4m3 scale per 16 channels) and its indexer keys and
queries as MXFP4 (e2m1 codes, one ue8m0 scale per 32 channels). The model rounds each row as it
is produced, so a row read back from the cache later (a prefix hit, the next chunk, a decode step)
equals the one the step that wrote it used: the rounding is a pure function of the row.

Plain torch. Every function takes rows [..., d] and returns them rounded, in their dtype; a last
partial group (d not a multiple of the group) is rounded as if zero-padded.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0
E2M1_MAX = 6.0
FP8_GROUP = 32  # window keys
MXFP4_GROUP = 32  # indexer keys and queries
NVFP4_GROUP = 16  # compressed entries
# e2m1's magnitudes, and the midpoints between neighbours (a value exactly on one rounds to the
# neighbour whose code is even: round half to even on the code, as a hardware cast does).
_E2M1_LEVELS = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def pow2_ceil(x: torch.Tensor) -> torch.Tensor:
    """The smallest power of two ≥ x (fp32, positive and normal), from its bits: no log rounding."""
    bits = x.float().contiguous().view(torch.int32)
    exponent = ((bits >> 23) & 255) + ((bits & 0x7FFFFF) != 0).int()
    return (exponent << 23).view(torch.float32)


def _groups(rows: torch.Tensor, group: int) -> torch.Tensor:
    """rows [..., d] → fp32 [..., ceil(d/group), group], zero-padded."""
    x = rows.float()
    return F.pad(x, (0, -x.shape[-1] % group)).unflatten(-1, (-1, group))


def _ungroup(grouped: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    return grouped.flatten(-2)[..., :like.shape[-1]].to(like.dtype)


def round_e2m1(x: torch.Tensor) -> torch.Tensor:
    """fp32 values in [−6, 6] → the nearest e2m1 value (ties to the even code)."""
    levels = x.new_tensor(_E2M1_LEVELS)
    midpoints = x.new_tensor(_E2M1_MIDPOINTS)
    magnitude = x.abs()
    index = torch.bucketize(magnitude, midpoints)  # a value on midpoint i gets level i (the lower)
    on_midpoint = magnitude == midpoints[index.clamp(max=len(_E2M1_MIDPOINTS) - 1)]
    index = index + (on_midpoint & (index % 2 == 1)).long()  # ... unless level i's code is odd
    return torch.copysign(levels[index], x)


def round_fp8(rows: torch.Tensor, group: int = FP8_GROUP) -> torch.Tensor:
    """Window keys: e4m3 codes times a power-of-two scale per `group` channels."""
    g = _groups(rows, group)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=1e-4) * (1 / E4M3_MAX))
    codes = (g / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float()
    return _ungroup(codes * scale, rows)


def round_mxfp4(rows: torch.Tensor, group: int = MXFP4_GROUP) -> torch.Tensor:
    """Indexer keys and queries: e2m1 codes times a power-of-two scale per `group` channels."""
    g = _groups(rows, group)
    scale = pow2_ceil(g.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-126) * (1 / E2M1_MAX))
    return _ungroup(round_e2m1((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale, rows)


def round_nvfp4(rows: torch.Tensor, group: int = NVFP4_GROUP) -> torch.Tensor:
    """Compressed entries: e2m1 codes times an e4m3 scale per `group` channels (amax / 6, rounded
    to e4m3: not a power of two, so the codes come from a true division)."""
    g = _groups(rows, group)
    scale = (g.abs().amax(-1, keepdim=True).clamp(min=E2M1_MAX * 2.0**-9) / E2M1_MAX)
    scale = scale.to(torch.float8_e4m3fn).float()
    return _ungroup(round_e2m1((g / scale).clamp(-E2M1_MAX, E2M1_MAX)) * scale, rows)
