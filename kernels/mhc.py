"""Manifold-constrained hyper-connections (mHC): the residual is hc parallel streams h [T, hc, D].

Before a sublayer (`mhc_pre`): RMS-normalised mixing weights from all streams give the input
gates `pre`, the output gates `post` and the stream-mixing matrix `comb`, which Sinkhorn
iterations project onto the doubly-stochastic matrices so the mixed residual cannot grow; the
sublayer's input is Σ_k pre_k h_k. After it (`mhc_post`): new stream k = post_k · y + Σ_j comb[j, k] h_j.

Plain torch, the twin of the Triton kernels in `mhc_triton.py` (same signatures).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from v4serve.kernels.norm_rope import rms_norm


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
            linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, D], fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3] →
    (x [T, D] in h's dtype, post [T, hc], comb [T, hc, hc]) (fp32 gates). With `norm_weight` [D],
    x is then RMS-normalised for the sublayer (its own norm, fused here). `linear` computes the
    mixing projection (a per-row form under --batch-invariant)."""
    hc = h.shape[1]
    flat = h.flatten(1).float()
    # The RMS factor is a per-row scalar, so it is applied after the projection: one op fewer.
    rs = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    z = torch.addcmul(base.float(), linear(flat, fn.float()) * rs,
                      scale.float().repeat_interleave(torch.tensor([hc, hc, hc * hc], device=scale.device)))
    pre_z, post_z, comb_z = z.split([hc, hc, hc * hc], dim=-1)
    pre = torch.sigmoid(pre_z) + hc_eps
    post = 2 * torch.sigmoid(post_z)
    comb = sinkhorn(torch.softmax(comb_z.unflatten(-1, (hc, hc)), dim=-1) + hc_eps, iters, hc_eps)
    x = torch.bmm(pre.unsqueeze(1), flat.view_as(h)).squeeze(1).to(h.dtype)  # Σ_k pre_k h_k
    return (x if norm_weight is None else rms_norm(x, norm_weight, norm_eps)), post, comb


def sinkhorn(comb: torch.Tensor, iters: int, hc_eps: float) -> torch.Tensor:
    """comb [T, hc, hc] > 0 → near doubly-stochastic: column sums, then `iters − 1` times rows and
    columns, each divided by its sum + eps. Row and column sums plus eps are one baddbmm each
    (eps + comb·1, eps + 1ᵀ·comb): two ops per half-iteration instead of three, on a loop that
    dominates the layer's op count."""
    hc = comb.shape[-1]
    eps = comb.new_full((1,), hc_eps)
    ones_col = comb.new_ones(1, hc, 1).expand(len(comb), hc, 1)
    ones_row = comb.new_ones(1, 1, hc).expand(len(comb), 1, hc)
    comb = comb / torch.baddbmm(eps, ones_row, comb)
    for _ in range(iters - 1):
        comb = comb / torch.baddbmm(eps, comb, ones_col)
        comb = comb / torch.baddbmm(eps, ones_row, comb)
    return comb


def mhc_post(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h [T, hc, D], y [T, D], post [T, hc], comb [T, hc, hc] → new streams [T, hc, D]."""
    mixed = torch.baddbmm(post.unsqueeze(-1) * y.float().unsqueeze(1), comb.transpose(-1, -2), h.float())
    return mixed.to(h.dtype)
