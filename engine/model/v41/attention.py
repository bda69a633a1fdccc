"""DeepSeek-V4.1 attention (CSA2): a sliding window on every layer, plus, on compressed layers,
the top-k of entries a KV source layer computed. One softmax over every key with a per-head
sink; K = V.

Four kinds of compressed layer, by what they compute themselves:
- a **KV source** pools its own entries (ratio 2: a softmax over each 2-token group per channel;
  ratio 1: one entry per token, a projection), the indexer's keys from them, and picks its top-k;
- a **re-index** layer reads the last source's entries and keys and picks its own top-k;
- a **reuse** layer attends to the last pick as it is;
- the **candidate stage** (on one source) keeps, per query, its best blocks of entries; every
  later re-index layer picks only among those.

Rounding as V4.1 stores its KV (kernels/kv_round.py): window keys FP8, entries NVFP4, indexer keys
and queries MXFP4; each row is rounded when it is made, so a row read back later is the one used.

Shapes: n = new tokens of the sequence, H = heads, d = head dim, N = entries, k = top-k,
hI/dI = indexer heads/dim, W = window.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from v4serve.engine.model.layers import RMSNorm, Rotary
from v4serve.engine.model.v41.config import V41Config
from v4serve.kernels.indexer import index_topk
from v4serve.kernels.kv_round import round_fp8, round_mxfp4, round_nvfp4
from v4serve.kernels.norm_rope import rms_norm, rope

QUERY_TILE = 256  # queries attended together (their gathered entries are [tile, k, d])


@dataclass
class SourceKV:
    """A KV source layer's entries so far, its indexer keys, and the rows of a group not yet whole."""
    entries: torch.Tensor  # [N, d], NVFP4-rounded, RoPE at each entry's first position
    index_keys: torch.Tensor  # [N, dI], MXFP4-rounded
    pending_kv: torch.Tensor  # [p, d] fp32 (p < ratio): the pooling's value rows of the open group
    pending_score: torch.Tensor  # [p, d] fp32: its score rows


@dataclass
class SequenceKV:
    """One sequence's V4.1 KV in private dense storage: what a State Cache slot and its blocks hold
    for it (the last W − 1 window rows per layer; per source its entries, keys and open group)."""
    length: int
    window: list[torch.Tensor]  # per layer [≤ W − 1, d]
    sources: dict[int, SourceKV] = field(default_factory=dict)

    @classmethod
    def empty(cls, cfg: V41Config, device: torch.device, dtype: torch.dtype) -> SequenceKV:
        d = cfg.head_dim
        window = [torch.empty(0, d, device=device, dtype=dtype) for _ in range(cfg.num_layers)]
        sources = {s: SourceKV(torch.empty(0, d, device=device, dtype=dtype),
                               torch.empty(0, cfg.index_head_dim, device=device, dtype=dtype),
                               torch.empty(0, d, device=device), torch.empty(0, d, device=device))
                   for s in cfg.kv_source_layers}
        return cls(0, window, sources)


@dataclass
class Pick:
    """What one step's compressed layers pass down: the last source's entries and keys, the last
    index layer's top-k, the candidate stage's blocks."""
    source: SourceKV | None = None
    ratio: int = 0
    topk: torch.Tensor | None = None  # [n, k] entry ids, −1 where fewer are visible
    candidates: torch.Tensor | None = None  # [n, N] bool

    def after(self, rows: int) -> Pick:
        """The same pick for the queries past the first `rows` (a layer that computes fewer rows)."""
        return Pick(self.source, self.ratio, None if self.topk is None else self.topk[rows:],
                    None if self.candidates is None else self.candidates[rows:])


class Compressor(nn.Module):
    """Pools each `ratio` tokens into one entry (a softmax over the group per channel; ratio 1 is
    the projection alone), then RMSNorm. Weights are fp32 in the checkpoint."""

    def __init__(self, cfg: V41Config, ratio: int) -> None:
        super().__init__()
        self.ratio = ratio
        self.wkv = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        if ratio > 1:
            self.wgate = nn.Linear(cfg.hidden_size, cfg.head_dim, bias=False)
        self.norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def latents(self, x: torch.Tensor, kv: SourceKV) -> torch.Tensor:
        """x [n, D] (the next tokens) → the unrotated entries they complete [n', d], keeping the
        rows of a group still open in `kv`."""
        if self.ratio == 1:
            return self.norm(F.linear(x, self.wkv.weight.to(x.dtype)))
        values = torch.cat([kv.pending_kv, F.linear(x.float(), self.wkv.weight.float())])
        scores = torch.cat([kv.pending_score, F.linear(x.float(), self.wgate.weight.float())])
        whole = values.shape[0] // self.ratio * self.ratio
        kv.pending_kv, kv.pending_score = values[whole:], scores[whole:]
        groups = values[:whole].unflatten(0, (-1, self.ratio))  # [n', m, d]
        weights = scores[:whole].unflatten(0, (-1, self.ratio)).softmax(dim=1)
        return self.norm((groups * weights).sum(dim=1).to(x.dtype))


class Indexer(nn.Module):
    """Scores I[t, s] = Σ_h relu(qI[t, h] · kI[s]) · w[t, h] · (hI·dI)^−½; keys only on a source."""

    def __init__(self, cfg: V41Config, layer: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.owns_keys = layer in cfg.kv_source_layers
        if self.owns_keys:
            self.wk = nn.Linear(cfg.head_dim, self.head_dim, bias=False)
            self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def keys(self, latents: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Unrotated entries [n', d] → indexer keys [n', dI]."""
        return round_mxfp4(rope(self.k_norm(self.wk(latents)), cos, sin))

    def scores(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> torch.Tensor:
        """x [n, D], query latent qr [n, q_lora], keys [N, dI] → scores [n, N] (unmasked)."""
        n = x.shape[0]
        q = round_mxfp4(rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), cos, sin))  # [n, hI, dI]
        w = self.weights_proj(x) * (self.head_dim**-0.5 * self.n_heads**-0.5)  # [n, hI]
        logits = torch.einsum("nhd,sd->nhs", q, keys).relu()  # [n, hI, N]
        return (logits * w[..., None]).sum(dim=1)


def candidate_blocks(scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block: int) -> torch.Tensor:
    """scores [n, N] (−inf where not visible), visible [n] → kept [n, N]: per query the entries of
    its best `topk_blocks` blocks of `block` entries by their best score, its last visible block
    always among them (ties as the indexer breaks them: lowest block first)."""
    width = scores.shape[-1]
    best = F.pad(scores, (0, -width % block), value=float("-inf")).unflatten(-1, (-1, block)).amax(-1)
    last = ((visible - 1) // block)[:, None]
    best = best.masked_fill(torch.arange(best.shape[-1], device=scores.device) == last, float("inf"))
    top = index_topk(best, (best > float("-inf")).sum(-1), topk_blocks)  # [n, topk_blocks], −1: none
    kept = torch.zeros(best.shape[0], best.shape[1] + 1, dtype=torch.bool, device=scores.device)
    kept = kept.scatter(-1, torch.where(top >= 0, top, best.shape[1]), True)[:, :-1]
    return kept.repeat_interleave(block, dim=-1)[:, :width] & (scores > float("-inf"))


class Attention(nn.Module):
    def __init__(self, cfg: V41Config, layer: int) -> None:
        super().__init__()
        self.cfg, self.layer = cfg, layer
        self.ratio = cfg.ratio(layer)
        h, d = cfg.num_heads, cfg.head_dim
        self.n_heads, self.head_dim, self.window = h, d, cfg.window
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.is_source = layer in cfg.kv_source_layers
        self.compressor = Compressor(cfg, self.ratio) if self.is_source else None
        self.indexer = Indexer(cfg, layer) if layer in cfg.index_source_layers else None

    def forward(self, x: torch.Tensor, kv: SequenceKV, pick: Pick, rotary: Rotary,
                cos_sin: tuple[torch.Tensor, torch.Tensor], start: int, ring: bool = True
                ) -> tuple[torch.Tensor, Pick]:
        """x [n, D] (tokens from position `start`) → [n, D] and the pick for the next layer. `ring`: the
        window rows kept in `kv` end just before `start` (False: this layer computes only the step's last
        rows, and its first W − 1 queries see a window cut short, which the layer above drops).
        `rotary`: this layer's angles (YaRN-scaled on compressed layers); `cos_sin`: its cos/sin at the
        tokens' positions (shared by the layers of a kind)."""
        n, eps = x.shape[0], self.cfg.rms_norm_eps
        qr = self.q_norm(self.wq_a(x))  # [n, q_lora]
        q = rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), *cos_sin)  # [n, H, d]
        new_kv = round_fp8(rope(rms_norm(self.wkv(x), self.kv_norm.weight, eps), *cos_sin))  # [n, d]
        window = torch.cat([kv.window[self.layer], new_kv]) if ring else new_kv  # positions start − w .. end − 1
        if self.ratio:
            pick = self._pick(x, qr, kv, pick, rotary, cos_sin, start)
        out = self._attend(q, window, start, pick if self.ratio else None)
        kv.window[self.layer] = window[max(0, window.shape[0] - (self.window - 1)):]
        out = rope(out, *cos_sin, inverse=True)  # V = K carried RoPE: rotate back
        groups = out.reshape(n, self.cfg.o_groups, -1)  # [n, G, H·d/G]
        wo_a = self.wo_a.weight.view(self.cfg.o_groups, self.cfg.o_lora_rank, -1)  # [G, O, H·d/G]
        return self.wo_b(torch.einsum("ngi,goi->ngo", groups, wo_a).flatten(1)), pick

    def _pick(self, x: torch.Tensor, qr: torch.Tensor, kv: SequenceKV, pick: Pick, rotary: Rotary,
              cos_sin: tuple[torch.Tensor, torch.Tensor], start: int) -> Pick:
        """A compressed layer's entries and top-k: made here (source, index layer) or passed down."""
        if self.compressor is not None:
            source = kv.sources[self.layer]
            latents = self.compressor.latents(x, source)
            # Entries of the groups closed this step, from `first`; those already held (a prefix hit's,
            # read from the Block Cache while the window is recomputed) are kept as they are.
            first = start // self.ratio
            known = source.entries.shape[0] - first
            assert known >= 0 and self.indexer is not None  # every source indexes
            if latents.shape[0] > known:
                at = torch.arange(first + known, first + latents.shape[0], device=x.device) * self.ratio
                latents = latents[known:]
                cos, sin = rotary.cos_sin(at)  # an entry rotates at its group's first position
                source.entries = torch.cat([source.entries, round_nvfp4(rope(latents, cos, sin))])
                source.index_keys = torch.cat([source.index_keys, self.indexer.keys(latents, cos, sin)])
            pick = Pick(source, self.ratio, None, pick.candidates if pick.ratio == self.ratio else None)
        if self.indexer is None:
            return pick
        assert pick.source is not None
        keys = pick.source.index_keys
        positions = torch.arange(start, start + x.shape[0], device=x.device)
        visible = (positions + 1) // self.ratio  # [n]: entries whose group is whole
        scores = self.indexer.scores(x, qr, keys, *cos_sin)
        scores = scores.masked_fill(torch.arange(keys.shape[0], device=x.device) >= visible[:, None], float("-inf"))
        candidates = pick.candidates
        if self.layer == self.cfg.candidate_layer:
            candidates = candidate_blocks(scores, visible, self.cfg.candidate_topk_blocks,
                                          self.cfg.candidate_block_size)
        elif self.cfg.uses_candidates(self.layer):
            assert candidates is not None
            scores = scores.masked_fill(~candidates, float("-inf"))
        # Ties are real (a score is exactly 0 wherever every head's relu is): V4's rule breaks them,
        # lowest entry first, so a position picks the same entries in a decode step as in any chunk.
        ids = index_topk(scores, (scores > float("-inf")).sum(-1), self.indexer.topk)  # [n, k], −1: none
        return Pick(pick.source, self.ratio, ids, candidates)

    def _attend(self, q: torch.Tensor, window: torch.Tensor, start: int, pick: Pick | None) -> torch.Tensor:
        """q [n, H, d], window rows [w + n, d] (the last w before the step, then the step's) →
        [n, H, d]: one softmax over each query's window, its picked entries and the sink."""
        n = q.shape[0]
        before = window.shape[0] - n
        out = torch.empty_like(q)
        scale = self.head_dim**-0.5
        picks = pick is not None and pick.topk is not None and pick.source is not None and len(pick.source.entries) > 0
        for a in range(0, n, QUERY_TILE):
            z = min(a + QUERY_TILE, n)
            lo = max(0, before + a - (self.window - 1))  # the tile's first query sees back to here
            keys = window[lo:before + z].float()  # [s, d]
            key_pos = torch.arange(start - before + lo, start + z, device=q.device)
            pos = torch.arange(start + a, start + z, device=q.device)[:, None]
            seen = (key_pos <= pos) & (key_pos > pos - self.window)  # [t, s]
            qt = q[a:z].float()
            logits = torch.einsum("thd,sd->ths", qt, keys) * scale
            logits = logits.masked_fill(~seen[:, None, :], float("-inf"))
            parts = [logits]
            if picks:
                assert pick is not None and pick.source is not None and pick.topk is not None
                ids = pick.topk[a:z]
                picked = pick.source.entries[ids.clamp(min=0)].float()  # [t, k, d]
                entry_logits = torch.einsum("thd,tkd->thk", qt, picked) * scale
                parts.append(entry_logits.masked_fill(~(ids >= 0)[:, None, :], float("-inf")))
            parts.append(self.attn_sink.float()[None, :, None].expand(z - a, -1, 1))
            probs = torch.cat(parts, dim=-1).softmax(dim=-1)  # the sink's value is zero
            o = torch.einsum("ths,sd->thd", probs[..., :keys.shape[0]], keys)
            if picks:
                o = o + torch.einsum("thk,tkd->thd", probs[..., keys.shape[0]:-1], picked)
            out[a:z] = o.to(q.dtype)
        return out
