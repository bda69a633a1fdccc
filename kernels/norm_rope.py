"""RMSNorm and rotary embeddings, alone or fused (`rms_norm_rope`): plain torch, the twin of
`norm_rope_triton.py` (same signatures).

RoPE is interleaved: the pairs (x_2i, x_2i+1) of the trailing r dims of each vector rotate by the
angle of pair i at the row's position; cos/sin are [n, r/2] for the n leading rows (every head of a
row shares them). Norms compute in fp32 and return the input's dtype.
"""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """x [..., D], weight [D] or None (a unit norm, as on per-head queries) → [..., D]."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 if weight is None else weight * x32).to(x.dtype)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False,
         out: torch.Tensor | None = None) -> torch.Tensor:
    """Rotate the trailing r dims of x [n, ..., D] pairwise by cos/sin [n, r/2] (`inverse`: rotate back).
    `out` is a dead buffer the result may be written into (the Triton twin does; here a new tensor is
    returned either way)."""
    if inverse:
        sin = -sin
    r = cos.shape[-1] * 2
    # A pair (x0, x1) times cos + i·sin as complex numbers is (x0·cos − x1·sin, x1·cos + x0·sin):
    # the same arithmetic as written out, in four ops instead of ten.
    turn = torch.complex(cos.float(), sin.float()).view(cos.shape[0], *([1] * (x.dim() - 2)), -1)
    pairs = torch.view_as_complex(x[..., -r:].float().unflatten(-1, (-1, 2)))
    rotated = torch.view_as_real(pairs * turn).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


def rms_norm_rope(x: torch.Tensor, weight: torch.Tensor | None, eps: float, cos: torch.Tensor,
                  sin: torch.Tensor) -> torch.Tensor:
    """RMSNorm over the last dim, then RoPE on its trailing r dims."""
    return rope(rms_norm(x, weight, eps), cos, sin)
