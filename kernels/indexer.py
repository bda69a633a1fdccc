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
    """scores [R, n] (−inf past each row's count), counts [R], k → the k best entries of each
    row [R, k], −1 where a row sees fewer than k. `full` promises that every row sees at least k
    (the caller knows it on the host), so nothing needs masking.

    The picks are exactly the Triton kernel's, in its order: with t the row's min(count, k)-th best
    score, every entry above t, then as many of those equal to t as it takes, lowest entry first,
    each group in entry order. Ties are real (a score is exactly 0 wherever every head's relu is),
    and a tie broken by the row's shape would let a decode step attend other entries than the same
    position inside a prefill chunk.

    On the CPU one top-k decides almost every row: unless the next best score equals t, its picks
    are every entry ≥ t whatever order the top-k found them in, and only their order is left to
    fix. The few rows whose ties at t run past the picks take the exact form (`_ranked_topk`). On
    another device, finding those rows would make the host wait for the device (and could not be
    captured in a graph), so every row takes the exact form there."""
    if scores.device.type != "cpu" or k == 0:
        return _ranked_topk(scores, counts, k, full)
    n = scores.shape[-1]
    # One score more than the picks, to see whether the ties at t run past them.
    width = max(n, k + 1)
    padded = scores if n == width else torch.nn.functional.pad(scores, (0, width - n), value=float("-inf"))
    values, entries = padded.topk(k + 1, dim=-1)  # [R, k + 1], best first
    if full:
        threshold, after = values[:, k - 1:k], values[:, k:]
    else:
        picks = counts.clamp(max=k)[:, None]  # [R, 1]
        threshold, after = values.gather(1, (picks - 1).clamp(min=0)), values.gather(1, picks)
    # Entry order within each group (above t, then the ties, then what is not picked): one sort of
    # k keys, not of n.
    best = values[:, :k]
    group = (best <= threshold).long() + (best < threshold).long()  # 0 above t, 1 at t, 2 below
    top = (entries[:, :k] + group * width).sort(-1).values.remainder_(width)
    crossing = (after == threshold) | values[:, :1].isnan()  # a NaN outranks all: the exact form decides
    if not full:
        crossing &= picks > 0  # a row that sees nothing is all −1 anyway
        top.masked_fill_(torch.arange(k, device=top.device)[None, :] >= picks, -1)
    exact = crossing.squeeze(1).nonzero().squeeze(1)
    if len(exact):
        top[exact] = _ranked_topk(scores[exact], counts[exact], k, full)
    return top


def _ranked_topk(scores: torch.Tensor, counts: torch.Tensor, k: int, full: bool) -> torch.Tensor:
    """`index_topk`'s picks by ranking every entry of every row (above t, then the ties t needs,
    each in entry order) and taking the k best ranks: no host read, the same ops for every row."""
    if scores.shape[-1] < k:  # fewer entries than picks (early in a sequence): the rest stay −1
        scores = torch.nn.functional.pad(scores, (0, k - scores.shape[-1]), value=float("-inf"))
    n = scores.shape[-1]
    best = scores.topk(k, dim=-1).values  # [R, k]
    if full:
        picks, threshold = k, best[:, -1:]
    else:
        picks = counts.clamp(max=k)[:, None]  # [R, 1]
        threshold = best.gather(1, (picks - 1).clamp(min=0))  # [R, 1]
    above, ties = scores > threshold, scores == threshold
    tied = ties & (ties.cumsum(-1) <= picks - above.sum(-1, keepdim=True))
    lower_first = torch.arange(n, 0, -1, device=scores.device)  # the lower an entry, the higher it ranks
    rank = above * (n + lower_first) + tied * lower_first  # above before ties, each in entry order; 0: not picked
    top = rank.topk(k, dim=-1).indices
    return top if full else top.masked_fill(torch.arange(k, device=top.device)[None, :] >= picks, -1)
