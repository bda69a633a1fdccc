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
from v4serve.engine.model.layers import RMSNorm, Rotary
from v4serve.engine.model.metadata import SeqChunk
from v4serve.engine.model.parallel import ParallelConfig, all_reduce_sum
from v4serve.kernels.compressor import pool
from v4serve.kernels.norm_rope import rope
from v4serve.kernels.paged import ring_read, ring_write
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
        bias (`with_bias`; the decode kernel adds it itself)."""
        return outputs[self.wkv].float(), outputs[self.wgate].float()

    def with_bias(self, score: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Score rows [n, c·d] of tokens at `positions` [n] plus their slot's position bias `ape`."""
        return score + self.ape[positions % self.ratio].float()

    def update(self, kv: torch.Tensor, score: torch.Tensor, seq: SeqChunk, ring_kv: torch.Tensor,
               ring_score: torch.Tensor, rotary: Rotary) -> tuple[torch.Tensor, int]:
        """One sequence's new rows → (entries finished by them [k, d], index of the first).
        Updates the ring in place. Entries below `frozen_until` are already cached: skipped."""
        m = self.ratio
        first = max(seq.start // m, seq.frozen_until // m)
        stop = seq.end // m
        entries = kv.new_zeros(0, self.head_dim)
        if first < stop:
            lo = (first - 1) * m if self.overlap else first * m
            rows_kv, rows_score = self._rows(kv, score, seq, lo, ring_kv, ring_score)
            windows = rows_kv.shape[0] // m
            entries = self._pool(rows_kv.view(1, windows, m, -1), rows_score.view(1, windows, m, -1),
                                 torch.arange(first, stop, device=kv.device), rotary)[0]
        ring_write(ring_kv, seq.end, kv)
        ring_write(ring_score, seq.end, score)
        return entries, first

    def _rows(self, kv: torch.Tensor, score: torch.Tensor, seq: SeqChunk, lo: int, ring_kv: torch.Tensor,
              ring_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows for positions [lo, end): ring rows below `start`, new rows above; positions below
        zero are empty slots (zero kv, −inf score). Trailing partial-window rows are dropped."""
        parts_kv, parts_score = [], []
        if lo < 0:
            parts_kv.append(kv.new_zeros(-lo, kv.shape[1]))
            parts_score.append(score.new_full((-lo, score.shape[1]), float("-inf")))
        if max(lo, 0) < seq.start:
            held = torch.arange(max(lo, 0), seq.start, device=kv.device)
            parts_kv.append(ring_read(ring_kv, held).float())
            parts_score.append(ring_read(ring_score, held).float())
        skip = max(lo - seq.start, 0)
        parts_kv.append(kv[skip:])
        parts_score.append(score[skip:])
        rows_kv, rows_score = torch.cat(parts_kv), torch.cat(parts_score)
        usable = (seq.end // self.ratio) * self.ratio - lo
        return rows_kv[:usable], rows_score[:usable]

    def _pool(self, win_kv: torch.Tensor, win_score: torch.Tensor, index: torch.Tensor,
              rotary: Rotary) -> torch.Tensor:
        """win_* [B, w, m, c·d]: consecutive windows → entries [B, E, d] (kernels/compressor.py)."""
        return pool(win_kv, win_score, index, self.ratio, self.overlap, self.norm.weight, self.norm.eps,
                    rotary.inv_freq)


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

    def select(self, q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [B, n, hI, dI], w [B, n, hI] (unscaled), keys [B, N, dI], visible [B, n, N] →
        (indices [B, n, k], valid [B, n, k]): the top-k visible entries for each query."""
        logits = torch.bmm(q.flatten(1, 2), keys.transpose(1, 2)).unflatten(1, q.shape[1:3]).relu_()  # [B, n, hI, N]
        scores = self.summed(((w * self.w_scale).unsqueeze(-2) @ logits).squeeze(-2))  # Σ_h w·relu(q·k) [B, n, N]
        scores = scores.masked_fill(~visible, float("-inf"))
        top = scores.topk(min(self.topk, keys.shape[1]), dim=-1).indices
        return top, visible.gather(-1, top)
