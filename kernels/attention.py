"""Attention over a window plus compressed entries, one softmax with a per-head sink; V = K.

`sparse_attention` is the plain-torch reference; a GPU kernel can replace it behind the same
signature. Keys come in two groups: keys shared by the whole query tile (the window and, for HCA,
every visible entry) with a [n, L] mask, and keys picked per query (CSA top-k) with a [n, k] mask.
"""

from __future__ import annotations

import torch


def sparse_attention(q: torch.Tensor, shared: torch.Tensor, shared_mask: torch.Tensor,
                     picked: torch.Tensor | None, picked_mask: torch.Tensor | None,
                     sink: torch.Tensor, scale: float) -> torch.Tensor:
    """q [n, H, d]; shared [L, d], shared_mask [n, L]; picked [n, k, d], picked_mask [n, k];
    sink [H] → out [n, H, d]."""
    logits = torch.einsum("nhd,ld->nhl", q, shared) * scale
    logits = logits.masked_fill(~shared_mask[:, None, :], float("-inf"))
    parts = [logits]
    if picked is not None and picked_mask is not None:
        own = torch.einsum("nhd,nkd->nhk", q, picked.to(q.dtype)) * scale
        parts.append(own.masked_fill(~picked_mask[:, None, :], float("-inf")))
    parts.append(sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(logits.dtype))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    out = torch.einsum("nhl,ld->nhd", probs[..., : shared.shape[0]], shared)
    if picked is not None:
        out = out + torch.einsum("nhk,nkd->nhd", probs[..., shared.shape[0]: -1], picked.to(q.dtype))
    return out
