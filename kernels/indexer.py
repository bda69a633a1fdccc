"""The Lightning Indexer (plain torch): `index_scores` I[s] = Σ_h relu(qI_h·kI[s])·w_h over each
query's indexer keys, read through its block table (entries it cannot see yet score −inf), and
`index_topk`, the k best visible entries of each query. The twins of `indexer_triton`'s (same
signatures).

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


def index_topk(scores: torch.Tensor, counts: torch.Tensor, k: int, full: bool = False) -> torch.Tensor:
    """scores [R, n] (−inf past each row's count), counts [R], k ≤ n → the k best entries of each
    row [R, k] as a set (here in score order), −1 where a row sees fewer than k. `full` promises
    that every row sees at least k (the caller knows it on the host), so nothing needs masking."""
    top = scores.topk(k, dim=-1).indices
    return top if full else top.masked_fill(top >= counts[:, None], -1)
