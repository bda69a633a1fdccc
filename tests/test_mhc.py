"""mHC's mixing matrix in plain torch: the fast form (log domain, token axis innermost) and the
per-token form (--batch-invariant) against the Sinkhorn iterations as the model defines them,
computed in fp64."""

from __future__ import annotations

import pytest
import torch

from v4serve.kernels import mhc

ITERS, EPS = 20, 1e-6


def as_written(comb_z: torch.Tensor, iters: int, eps: float) -> torch.Tensor:
    """softmax over each row + eps; columns / (sum + eps); then iters − 1 times rows, then columns."""
    hc = int(comb_z.shape[-1] ** 0.5)
    comb = torch.softmax(comb_z.unflatten(-1, (hc, hc)), dim=-1) + eps
    comb = comb / (comb.sum(-2, keepdim=True) + eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + eps)
        comb = comb / (comb.sum(-2, keepdim=True) + eps)
    return comb


@pytest.mark.parametrize("sharpness", [0.1, 1.0, 8.0, 50.0])
@pytest.mark.parametrize("tokens", [1, 7, 300])
@pytest.mark.parametrize("iters", [1, 2, ITERS])
def test_mixing_matrix_equals_the_iterations_as_written(sharpness: float, tokens: int, iters: int) -> None:
    """Within fp32 noise, also for sharp logits, where a nearly empty column makes eps matter
    (dropping eps from the first column normalisation moves entries by ~1e-4 here), and for one
    iteration (no log-domain step at all)."""
    gen = torch.Generator().manual_seed(tokens)
    comb_z = torch.randn(tokens, 16, generator=gen) * sharpness
    want = as_written(comb_z.double(), iters, EPS)
    for form in (mhc.mixing_matrix, mhc.mixing_matrix_per_token):
        got = form(comb_z, iters, EPS)
        assert got.shape == (tokens, 4, 4) and got.dtype == torch.float32 and got.is_contiguous()
        # The log-domain form treats eps in later sums as a rescaling: O(eps) apart, less once the
        # sums near 1 (after the model's 20 iterations, ≤ 3e-7 here).
        tolerance = 5e-7 if iters == ITERS else 5 * EPS
        assert (got.double() - want).abs().max().item() <= tolerance, form.__name__


def test_per_token_mixing_matrix_does_not_depend_on_the_batch() -> None:
    comb_z = torch.randn(33, 16, generator=torch.Generator().manual_seed(1)) * 4
    batched = mhc.mixing_matrix_per_token(comb_z, ITERS, EPS)
    for row in (0, 7, 8, 32):
        assert torch.equal(mhc.mixing_matrix_per_token(comb_z[row:row + 1], ITERS, EPS)[0], batched[row])
