"""Manifold-constrained hyper-connections (mHC): the residual is hc parallel streams h [T, hc, D].

Before a sublayer (`mhc_pre`): RMS-normalised mixing weights from all streams give the input
gates `pre`, the output gates `post` and the stream-mixing matrix `comb`, which Sinkhorn
iterations project onto the doubly-stochastic matrices so the mixed residual cannot grow; the
sublayer's input is Σ_k pre_k h_k. After it (`mhc_post`): new stream k = post_k · y + Σ_j comb[j, k] h_j.

Plain torch, the twin of the Triton kernels in `mhc_triton.py` (same signatures).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable

import torch
import torch.nn.functional as F

from v4serve.kernels.norm_rope import rms_norm


@functools.cache
def _scale_index(hc: int, device: torch.device) -> torch.Tensor:
    """Which of the three scales (pre, post, comb) each of the (2+hc)·hc mixing logits takes."""
    return torch.tensor([0] * hc + [1] * hc + [2] * hc * hc, device=device)


def mixing_matrix(comb_z: torch.Tensor, iters: int, hc_eps: float) -> torch.Tensor:
    """comb_z [T, hc·hc] → comb [T, hc, hc]: softmax over each row + eps, then Sinkhorn iterations
    towards a doubly-stochastic matrix (column sums, then `iters − 1` times rows and columns, each
    divided by its sum + eps).

    Most of a decode step's ops are these iterations on 4×4 matrices, so the form is the cheapest
    one per op: the token axis innermost (reductions run across tokens, not along a row of 4), and
    after the first column normalisation, where a nearly empty column makes eps matter, the log
    domain, where a row or column normalisation is one log_softmax. There every sum is at least
    ~1/hc, so eps mostly rescales rows and columns (undone by the next normalisation) and the last
    one (the final division by 1 + eps): the two forms differ by O(eps), ≤ 3e-7 after 20
    iterations at eps = 1e-6, within fp32 noise (tests/test_mhc.py)."""
    hc = math.isqrt(comb_z.shape[-1])
    comb = torch.softmax(comb_z.t().unflatten(0, (hc, hc)), dim=1) + hc_eps  # [hc, hc, T]
    log_comb = torch.log(comb / (comb.sum(0, keepdim=True) + hc_eps))
    for _ in range(iters - 1):
        log_comb = log_comb.log_softmax(1).log_softmax(0)
    if iters > 1:  # the last column normalisation ran in the log domain: its eps
        log_comb = log_comb.sub_(math.log1p(hc_eps))
    return log_comb.exp_().permute(2, 0, 1).contiguous()


def mixing_matrix_per_token(comb_z: torch.Tensor, iters: int, hc_eps: float) -> torch.Tensor:
    """`mixing_matrix` computed as written, one token per batch entry of every op: a token's matrix
    is bitwise the same whatever its batch (the token-innermost form vectorises across tokens, so
    there a token's rounding depends on its neighbours)."""
    hc = math.isqrt(comb_z.shape[-1])
    return sinkhorn(torch.softmax(comb_z.unflatten(-1, (hc, hc)), dim=-1) + hc_eps, iters, hc_eps)


def sinkhorn(comb: torch.Tensor, iters: int, hc_eps: float) -> torch.Tensor:
    """comb [T, hc, hc] > 0 → near doubly-stochastic: column sums, then `iters − 1` times rows and
    columns, each divided by its sum + eps. Row and column sums plus eps are one baddbmm each
    (eps + comb·1, eps + 1ᵀ·comb): two ops per half-iteration instead of three."""
    hc = comb.shape[-1]
    eps = comb.new_full((1,), hc_eps)
    ones_col = comb.new_ones(1, hc, 1).expand(len(comb), hc, 1)
    ones_row = comb.new_ones(1, 1, hc).expand(len(comb), 1, hc)
    comb = comb / torch.baddbmm(eps, ones_row, comb)
    for _ in range(iters - 1):
        comb = comb / torch.baddbmm(eps, comb, ones_col)
        comb = comb / torch.baddbmm(eps, ones_row, comb)
    return comb


def mhc_pre(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
            norm_eps: float, iters: int, norm_weight: torch.Tensor | None = None,
            linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
            mixing: Callable[[torch.Tensor, int, float], torch.Tensor] = mixing_matrix
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, D], fn [(2+hc)·hc, hc·D], base [(2+hc)·hc], scale [3] →
    (x [T, D] in h's dtype, post [T, hc], comb [T, hc, hc]) (fp32 gates). With `norm_weight` [D],
    x is then RMS-normalised for the sublayer (its own norm, fused here). `linear` computes the
    mixing projection and `mixing` the matrix from its logits (per-token forms under --batch-invariant)."""
    pre, post, comb = mhc_coefficients(h, fn, base, scale, hc_eps, norm_eps, iters, linear, mixing)
    x = collapse(h, pre)
    return (x if norm_weight is None else rms_norm(x, norm_weight, norm_eps)), post, comb


def mhc_coefficients(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, hc_eps: float,
                     norm_eps: float, iters: int,
                     linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
                     mixing: Callable[[torch.Tensor, int, float], torch.Tensor] = mixing_matrix
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gates alone: h [T, hc, D] → (pre [T, hc], post [T, hc], comb [T, hc, hc]), fp32. V4 collapses
    the streams with its own `pre`; V4.1's single pass collapses them with the previous sublayer's."""
    hc = h.shape[1]
    flat = h.flatten(1).float()
    # The RMS factor is a per-row scalar, so it is applied after the projection: one op fewer.
    rs = torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    z = torch.addcmul(base.float(), linear(flat, fn.float()) * rs, scale.float()[_scale_index(hc, scale.device)])
    gates = torch.sigmoid(z[:, :2 * hc])
    return gates[:, :hc] + hc_eps, gates[:, hc:] * 2, mixing(z[:, 2 * hc:], iters, hc_eps)


def collapse(h: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
    """h [T, hc, D], pre [T, hc] → Σ_k pre_k h_k [T, D] in h's dtype."""
    return torch.bmm(pre.unsqueeze(1), h.float()).squeeze(1).to(h.dtype)


def mhc_post(h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
    """h [T, hc, D], y [T, D], post [T, hc], comb [T, hc, hc] → new streams [T, hc, D]."""
    mixed = torch.baddbmm(post.unsqueeze(-1) * y.float().unsqueeze(1), comb.transpose(-1, -2), h.float())
    return mixed.to(h.dtype)
