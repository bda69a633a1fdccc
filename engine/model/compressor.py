"""The compressors and the Lightning Indexer of DeepSeek-V4's compressed layers.

A compressor pools every m tokens into one entry: a softmax over the m token slots per channel
(CSA overlaps: entry i also pools window i−1 through the first half of a 2d-wide projection),
then RMSNorm and RoPE at position i·m. Its pending rows live in a State Cache ring; finished entries
go to the Block Cache. The indexer keeps its own (overlapping) compressor for its keys and picks,
per query, the top-k CSA entries by I[t,s] = Σ_h relu(qI[t,h]·kI[s]) · w[t,h].

Shapes: T = tokens in the batch, D = sequences decoding one token each, m = compress ratio,
c·d = projection width (c = 2 with overlap), E = entries, hI/dI = indexer heads/dim.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.layers import RMSNorm
from v4serve.engine.model.parallel import ParallelConfig, all_reduce_sum
from v4serve.kernels.norm_rope import rope
from v4serve.kernels.registry import load_kernels


class Compressor(nn.Module):
    """Pools every m tokens into one entry: softmax over the m slots per channel (plus, with
    overlap, the previous window's m slots through the first half of the projection), then
    RMSNorm and RoPE at position i·m. Pending rows live in the slot's ring (token p at p mod R)."""

    def __init__(self, dim: int, head_dim: int, ratio: int, overlap: bool, eps: float) -> None:
        super().__init__()
        self.head_dim, self.ratio, self.overlap = head_dim, ratio, overlap
        width = (2 if overlap else 1) * head_dim
        self.wkv = nn.Linear(dim, width, bias=False)
        self.wgate = nn.Linear(dim, width, bias=False)
        self.ape = nn.Parameter(torch.zeros(ratio, width))
        self.norm = RMSNorm(head_dim, eps)
        self.kernels = load_kernels("torch")

    def inputs(self) -> list[nn.Linear]:
        """The projections of the layer input x (run with the attention's others: `SharedInput`)."""
        return [self.wkv, self.wgate]

    def project(self, outputs: dict[nn.Linear, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """Projections of x → kv and score rows [T, c·d], the score still without the slot's position
        bias (the compressor kernels add it)."""
        return outputs[self.wkv].float(), outputs[self.wgate].float()


class Indexer(nn.Module):
    """Lightning Indexer: I[t,s] = Σ_h relu(qI[t,h]·kI[s]) · w[t,h]; top-k picks CSA entries. Under
    tensor parallelism a rank holds hI/N heads: its scores are partial sums over heads, all-reduced
    (`summed`) before any top-k so that every rank picks the same entries."""

    def __init__(self, cfg: ModelConfig, ratio: int, parallel: ParallelConfig | None = None) -> None:
        super().__init__()
        ranks = parallel.size if parallel is not None else 1
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads // ranks, cfg.index_head_dim, cfg.index_topk
        self.total_heads = cfg.index_n_heads  # the scale averages over all heads, not this rank's
        self.reduce = all_reduce_sum if ranks > 1 else None
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, cfg.rms_norm_eps)
        self.kernels = load_kernels("torch")

    def inputs(self) -> list[nn.Linear]:
        """The projections of the layer input x (run with the attention's others: `SharedInput`)."""
        return [self.weights_proj, *self.compressor.inputs()]

    def queries(self, outputs: dict[nn.Linear, torch.Tensor], cos: torch.Tensor, sin: torch.Tensor,
                rotate: Callable[..., torch.Tensor] = rope) -> tuple[torch.Tensor, torch.Tensor]:
        """Projections of x and of the query latent qr → (qI [T, hI, dI] with RoPE, head weights
        w [T, hI], still to be multiplied by `w_scale`: the score kernel does it)."""
        q = outputs[self.wq_b]
        q = rotate(q.view(q.shape[0], self.n_heads, self.head_dim), cos, sin).float()
        return q, outputs[self.weights_proj].float()

    @property
    def w_scale(self) -> float:
        """Both of the indexer's scales: the heads' mean and the dot product's."""
        return self.total_heads**-0.5 * self.head_dim**-0.5

    def summed(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores [..., N] over this rank's heads → over all heads (−inf where not visible: the
        same entries on every rank, and −inf + −inf stays −inf)."""
        return scores if self.reduce is None else self.reduce(scores)

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """q [n, hI, dI], w [n, hI] (unscaled), keys [N, dI], counts [n] (entries each query sees) →
        scores [n, N], −inf where not visible (the shared-keys form of `kernels.index_scores`)."""
        logits = torch.bmm(q.flatten(0, 1)[None], keys.t()[None])[0].unflatten(0, q.shape[:2]).relu_()  # [n, hI, N]
        scores = self.summed(((w * self.w_scale).unsqueeze(-2) @ logits).squeeze(-2))  # Σ_h w·relu(q·k) [n, N]
        hidden = torch.arange(keys.shape[0], device=q.device)[None, :] >= counts[:, None]
        return scores.masked_fill(hidden, float("-inf"))
