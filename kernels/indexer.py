"""The Lightning Indexer's scores for decoding sequences (plain torch): I[s] = Σ_h relu(qI_h·kI[s])·w_h
over each sequence's indexer keys, read through its block table; entries a query cannot see yet
score −inf. The twin of `indexer_triton.index_scores` (same signature); top-k selection follows in
torch.

Shapes: R = queries (one per decoding sequence), hI/dI = indexer heads/dim, P = entries per block,
n = entries scored (the most any of the R sequences has).
"""

from __future__ import annotations

import torch

from v4serve.kernels.paged import read_entries_batched


def index_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, tables: torch.Tensor, counts: torch.Tensor,
                 n: int, w_scale: float = 1.0) -> torch.Tensor:
    """q [R, hI, dI], w [R, hI] (times `w_scale`, applied here), keys [NB, P, dI], tables [R, nb],
    counts [R] (visible entries) → scores [R, n] (fp32)."""
    k = read_entries_batched(keys, tables, n)  # [R, n, dI]
    logits = torch.bmm(q.float(), k.transpose(1, 2)).relu_()  # [R, hI, n]
    scores = ((w.float() * w_scale).unsqueeze(1) @ logits).squeeze(1)  # Σ_h w·relu(q·k)
    return scores.masked_fill(torch.arange(n, device=q.device)[None, :] >= counts[:, None], float("-inf"))
