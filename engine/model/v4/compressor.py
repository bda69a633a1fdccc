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
from v4serve.engine.model.parallel.sharding import ParallelConfig, all_reduce_sum
from v4serve.kernels.norm_rope import rope
from v4serve.kernels.registry import load_kernels

# The torch scoring's blocks (`Indexer.scores`): per-head logits of a few rows by up to this many
# entries, at most this many fp32 values (4 MiB: stays in a CPU's L3 between the three passes).
INDEX_BLOCK_ENTRIES = 2048
INDEX_BLOCK_LOGITS = 1 << 20


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

    def scores(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, counts: torch.Tensor,
               seen_by_all: int = 0) -> torch.Tensor:
        """q [n, hI, dI], w [n, hI] (unscaled), keys [N, dI], counts [n] (entries each query sees) →
        scores [n, N], −inf where not visible (the shared-keys form of `kernels.index_scores`).
        `seen_by_all`: entries every query sees (known on the host), left unmasked.

        The per-head logits [n, hI, N] of a whole tile are far larger than a CPU's caches, and
        writing them out, rectifying them and reading them back made scoring memory-bound. So they
        go in blocks of a few rows by some entries that stay in cache between the three passes. The
        scores are the whole tile's within fp32 noise (a GEMM's rounding depends on its width, as
        the whole tile's did on the tile's); exact zeros stay exact, so do the ties among them."""
        n, heads = q.shape[:2]
        entries = keys.shape[0]
        width, rows = max(entries, 1), n
        if q.device.type == "cpu":  # a GPU streams the whole tile at full speed, and each block is a launch
            width = min(width, INDEX_BLOCK_ENTRIES)
            rows = max(1, INDEX_BLOCK_LOGITS // (heads * width))
        weights = (w * self.w_scale).unsqueeze(-2)  # [n, 1, hI]
        flat = q.flatten(0, 1)  # [n·hI, dI]
        scores = q.new_empty(n, entries)
        # One buffer for every block's logits: a fresh one per block would be a fresh mapping of
        # pages to fault in each time (allocations this large bypass the allocator's free lists).
        buffer = q.new_empty(min(rows, n) * heads * width)
        for a in range(0, n, rows):
            z = min(a + rows, n)
            for b in range(0, entries, width):
                e = min(b + width, entries)
                logits = buffer[:(z - a) * heads * (e - b)].view((z - a) * heads, e - b)
                torch.mm(flat[a * heads:z * heads], keys[b:e].t(), out=logits)
                torch.matmul(weights[a:z], logits.view(z - a, heads, e - b).relu_(), out=scores[a:z, None, b:e])
        scores = self.summed(scores)
        # Only the entries some query does not see yet need the mask (a chunk's last few).
        hidden = torch.arange(seen_by_all, entries, device=q.device)[None, :] >= counts[:, None]
        scores[:, seen_by_all:].masked_fill_(hidden, float("-inf"))
        return scores
