"""Engram: DeepSeek-V4.1's n-gram memory. Before the blocks that have one, each token's last n
tokens (n = 2..N) are hashed into rows of a large table; the rows read are projected into one
key per residual stream and one value, and each stream adds the value through its own gate.

The hash reads token ids through a map that folds tokens that normalise to the same text (case,
accents, runs of whitespace) into one id; the map comes from the tokenizer, so the same text
reaches the same rows whatever its tokenisation's surface form. Per layer and n-gram order,
`n_heads` prime-sized buckets; odd multipliers per layer, drawn from a generator seeded by the
layer id (both as DeepSeek specifies them, so a checkpoint's tables are addressed as trained).

Shapes: n = new tokens, hc = residual streams, D = hidden size, K = hash heads = (N − 1)·heads,
e = head dim (the width of a table row).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from v4serve.engine.model.v41.config import V41Config


def _is_prime(n: int) -> bool:
    if n < 2:
        return False
    if n % 2 == 0:
        return n == 2
    return all(n % d for d in range(3, math.isqrt(n) + 1, 2))


class NgramHash:
    """Token ids → table rows for every Engram layer. Plain integer arithmetic on the host's or the
    model's device; a token's rows depend only on it and the (N − 1) tokens before it."""

    def __init__(self, cfg: V41Config, token_map: Sequence[int]) -> None:
        self.max_ngram, self.n_heads = cfg.engram_max_ngram, cfg.engram_n_heads
        folded = max(token_map) + 1
        if cfg.engram_compressed_vocab_size and folded != cfg.engram_compressed_vocab_size:
            raise ValueError(f"the tokenizer folds into {folded} Engram ids, the checkpoint expects "
                             f"{cfg.engram_compressed_vocab_size}: this tokenizer is not the checkpoint's")
        # On the host, even when the model is built on `meta` to be loaded: rows() moves them.
        self.token_map = torch.tensor(list(token_map), dtype=torch.long, device="cpu")
        self.pad = int(token_map[cfg.engram_pad_token_id])
        bound = max(1, (np.iinfo(np.int64).max // folded) // 2)  # products stay within int64
        used: set[int] = set()
        primes, offsets, multipliers = [], [], []
        for layer, rows in zip(cfg.engram_layers, cfg.engram_num_embeddings, strict=True):
            mine = []
            for _order in range(self.max_ngram - 1):
                p = cfg.engram_vocab_size - 1
                for _head in range(self.n_heads):
                    p += 1
                    while not _is_prime(p) or p in used:
                        p += 1
                    used.add(p)
                    mine.append(p)
            if sum(mine) > rows:
                raise ValueError(f"Engram layer {layer}'s buckets need {sum(mine)} table rows, it has {rows}")
            primes.append(mine)
            offsets.append([0, *np.cumsum(mine[:-1]).tolist()])
            draws = np.random.default_rng(10007 * layer).integers(0, bound, size=(self.max_ngram,), dtype=np.int64)
            multipliers.append((draws * 2 + 1).tolist())
        self.primes = torch.tensor(primes, dtype=torch.long, device="cpu")  # [L, K]
        self.offsets = torch.tensor(offsets, dtype=torch.long, device="cpu")  # [L, K]
        self.multipliers = torch.tensor(multipliers, dtype=torch.long, device="cpu")  # [L, N]

    def rows(self, history: torch.Tensor, num_new: int) -> torch.Tensor:
        """history [P + n] (the n new tokens preceded by up to N − 1 earlier ones, P of them; fewer
        only at the sequence's start) → table rows [n, L, K] of the new tokens."""
        ids = self.token_map.to(history.device)[history.long()]
        first = history.shape[0] - num_new
        grams = []
        for shift in range(self.max_ngram):
            at = torch.arange(first, first + num_new, device=ids.device) - shift
            grams.append(torch.where(at >= 0, ids[at.clamp(min=0)], self.pad))  # before the start: padding
        tokens = torch.stack(grams, dim=-1)  # [n, N]: the token, then the ones before it
        products = tokens[:, None, :] * self.multipliers.to(ids.device)  # [n, L, N]
        rolling, out = products[..., 0], []
        primes = self.primes.to(ids.device)
        for order in range(1, self.max_ngram):
            rolling = torch.bitwise_xor(rolling, products[..., order])
            heads = slice((order - 1) * self.n_heads, order * self.n_heads)
            out.append(rolling[..., None] % primes[None, :, heads])
        return torch.cat(out, dim=-1) + self.offsets.to(ids.device)


class Engram(nn.Module):
    """One layer's memory: table rows → keys per stream and a value; each stream adds the value
    times sigmoid(signed √(its RMS-normalised dot product with its key))."""

    def __init__(self, cfg: V41Config, layer: int) -> None:
        super().__init__()
        self.slot = cfg.engram_layers.index(layer)  # which of the hash's layers
        self.hc, self.dim, self.eps = cfg.hc_mult, cfg.hidden_size, cfg.rms_norm_eps
        rows = cfg.engram_num_embeddings[self.slot]
        self.embed = nn.Embedding(rows, cfg.engram_head_dim, _weight=torch.empty(rows, cfg.engram_head_dim))
        self.wkv = nn.Linear(cfg.engram_hash_heads * cfg.engram_head_dim, (cfg.hc_mult + 1) * cfg.hidden_size,
                             bias=False)
        self.q_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))
        self.k_weight = nn.Parameter(torch.ones(cfg.hc_mult, cfg.hidden_size))

    def forward(self, h: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """h [n, hc, D], rows [n, K] → h [n, hc, D] with the memory added."""
        e = self.embed(rows).flatten(-2).to(h.dtype)  # [n, K·e]
        key, value = self.wkv(e).split((self.hc * self.dim, self.dim), dim=-1)
        key = key.float().unflatten(-1, (self.hc, self.dim))  # [n, hc, D]
        x = h.float()
        rstd = torch.rsqrt(x.square().mean(-1) + self.eps) * torch.rsqrt(key.square().mean(-1) + self.eps)
        dot = (x * (self.q_weight.float() * self.k_weight.float()) * key).sum(-1) * rstd * self.dim**-0.5
        gate = torch.sigmoid(torch.copysign(dot.abs().clamp(min=1e-6).sqrt(), dot))  # [n, hc]
        return (x + gate[..., None] * value.float()[:, None, :]).to(h.dtype)
