"""The DeepSeek-V4 model, written against the paper's notation.

Parameter names are the official checkpoint names, so a state_dict maps one to one onto a
checkpoint. Shapes in comments: T = tokens in the flattened batch, n = one sequence's new tokens,
H = attention heads, d = head dim, r = rope dims, m = compress ratio, hc = residual streams.

The forward pass takes a flattened batch of new tokens from several sequences plus an
`AttentionMetadata` describing each sequence (its State Cache slot, block table, start
position); all KV is read from and written to a `KVStorage`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from cache.storage import KVStorage, LayerKV
from engine.config import ModelConfig, YarnScaling
from engine.metadata import AttentionMetadata, SeqChunk
from kernels.attention import sparse_attention


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * x32).to(x.dtype)


def rms_unit(x: torch.Tensor, eps: float) -> torch.Tensor:
    """RMS normalisation without a weight (per-head query norm, mHC input norm)."""
    return x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps).to(x.dtype)


# ---- rotary embeddings ----------------------------------------------------------------------------


class Rotary:
    """Interleaved RoPE on the last r dims of a vector; YaRN-scaled frequencies when given."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnScaling | None) -> None:
        self.rope_dim = rope_dim
        self.inv_freq = self._inv_freq(rope_dim, theta, yarn)

    @staticmethod
    def _inv_freq(dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
        # Built on the CPU explicitly: the model may be constructed under the meta device.
        freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
        inv = 1.0 / freqs
        if yarn is None:
            return inv

        # YaRN: interpolate the slow (low-frequency) pairs by `factor`, keep the fast ones,
        # ramp linearly between; no attention-scale change (V4 applies none).
        def correction_dim(rotations: float) -> float:
            orig = yarn.original_max_position_embeddings
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return (inv / yarn.factor) * (1 - keep) + inv * keep

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [n, r/2]
        return freqs.cos(), freqs.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate the trailing r dims of x [n, ..., D] pairwise (x_2i, x_2i+1) by cos/sin [n, r/2]."""
    r = cos.shape[-1] * 2
    extra = x.dim() - 2
    cos = cos.view(cos.shape[0], *([1] * extra), -1)
    sin = sin.view(sin.shape[0], *([1] * extra), -1)
    rope = x[..., -r:].float().unflatten(-1, (-1, 2))
    x0, x1 = rope[..., 0], rope[..., 1]
    rotated = torch.stack((x0 * cos - x1 * sin, x1 * cos + x0 * sin), dim=-1).flatten(-2)
    return torch.cat([x[..., :-r], rotated.to(x.dtype)], dim=-1)


# ---- compressor -------------------------------------------------------------------------------------


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

    def forward(self, x: torch.Tensor, seq: SeqChunk, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                rotary: Rotary) -> tuple[torch.Tensor, int]:
        """x [n, D] → (new entries [k, d], index of the first). Updates the ring in place."""
        m, start, end = self.ratio, seq.start, seq.end
        positions = torch.arange(start, end, device=x.device)
        kv = self.wkv(x).float()  # [n, c·d]
        score = self.wgate(x).float() + self.ape[positions % m].float()
        first = max(start // m, seq.frozen_until // m)
        stop = end // m
        entries = x.new_zeros(0, self.head_dim)
        if first < stop:
            entries = self._pool(kv, score, seq, first, stop, ring_kv, ring_score, rotary)
        self._save_pending(kv, score, seq, ring_kv, ring_score)
        return entries, first

    def _rows(self, kv: torch.Tensor, score: torch.Tensor, seq: SeqChunk, lo: int,
              ring_kv: torch.Tensor, ring_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv/score rows for positions [lo, end): ring rows below `start`, new rows above;
        positions below zero are empty slots (zero kv, −inf score)."""
        parts_kv, parts_score = [], []
        if lo < 0:
            parts_kv.append(kv.new_zeros(-lo, kv.shape[1]))
            parts_score.append(score.new_full((-lo, score.shape[1]), float("-inf")))
        if max(lo, 0) < seq.start:
            old = torch.arange(max(lo, 0), seq.start, device=kv.device)
            rows = old % ring_kv.shape[0]
            parts_kv.append(ring_kv[rows].float())
            parts_score.append(ring_score[rows].float())
        skip = max(lo - seq.start, 0)
        parts_kv.append(kv[skip:])
        parts_score.append(score[skip:])
        return torch.cat(parts_kv), torch.cat(parts_score)

    def _pool(self, kv: torch.Tensor, score: torch.Tensor, seq: SeqChunk, first: int, stop: int,
              ring_kv: torch.Tensor, ring_score: torch.Tensor, rotary: Rotary) -> torch.Tensor:
        m, d, count = self.ratio, self.head_dim, stop - first
        lo = (first - 1) * m if self.overlap else first * m
        rows_kv, rows_score = self._rows(kv, score, seq, lo, ring_kv, ring_score)
        if self.overlap:
            # Entry i pools window i−1 through channels [:d] and window i through [d:].
            cur_kv = rows_kv[m: m + count * m, d:].view(count, m, d)
            cur_score = rows_score[m: m + count * m, d:].view(count, m, d)
            prev_kv = rows_kv[: count * m, :d].view(count, m, d)
            prev_score = rows_score[: count * m, :d].view(count, m, d)
            win_kv, win_score = torch.cat([prev_kv, cur_kv], 1), torch.cat([prev_score, cur_score], 1)
        else:
            win_kv = rows_kv[: count * m].view(count, m, d)
            win_score = rows_score[: count * m].view(count, m, d)
        pooled = (win_kv * win_score.softmax(dim=1)).sum(dim=1)  # [count, d]
        pooled = self.norm(pooled)
        cos, sin = rotary.cos_sin(torch.arange(first, stop, device=kv.device) * m)
        return apply_rope(pooled, cos, sin)

    @staticmethod
    def _save_pending(kv: torch.Tensor, score: torch.Tensor, seq: SeqChunk, ring_kv: torch.Tensor,
                      ring_score: torch.Tensor) -> None:
        keep = min(seq.num_new, ring_kv.shape[0])
        rows = torch.arange(seq.end - keep, seq.end, device=kv.device) % ring_kv.shape[0]
        ring_kv[rows] = kv[-keep:].to(ring_kv.dtype)
        ring_score[rows] = score[-keep:].to(ring_score.dtype)


# ---- block-cache access ------------------------------------------------------------------------------


def write_entries(store: torch.Tensor, block_table: list[int], first: int, entries: torch.Tensor) -> None:
    """Scatter entries first.. into the blocks they belong to (entry i → block i // per_block)."""
    if not len(entries):
        return
    per_block = store.shape[1]
    idx = torch.arange(first, first + len(entries))
    blocks = torch.tensor(block_table, dtype=torch.long)[idx // per_block]
    store[blocks.to(store.device), (idx % per_block).to(store.device)] = entries.to(store.dtype)


def read_entries(store: torch.Tensor, block_table: list[int], count: int) -> torch.Tensor:
    """Entries 0..count−1 of a sequence, gathered through its block table → [count, d]."""
    per_block = store.shape[1]
    nblocks = -(-count // per_block)
    blocks = torch.tensor(block_table[:nblocks], dtype=torch.long, device=store.device)
    return store[blocks].flatten(0, 1)[:count].float()


# ---- attention ------------------------------------------------------------------------------------------


# Queries per attention tile on long chunks.
ATTN_TILE = 256


class Indexer(nn.Module):
    """Lightning Indexer: I[t,s] = Σ_h relu(qI[t,h]·kI[s]) · w[t,h]; top-k picks CSA entries."""

    def __init__(self, cfg: ModelConfig, ratio: int) -> None:
        super().__init__()
        self.n_heads, self.head_dim, self.topk = cfg.index_n_heads, cfg.index_head_dim, cfg.index_topk
        self.wq_b = nn.Linear(cfg.q_lora_rank, self.n_heads * self.head_dim, bias=False)
        self.weights_proj = nn.Linear(cfg.hidden_size, self.n_heads, bias=False)
        self.compressor = Compressor(cfg.hidden_size, self.head_dim, ratio, True, cfg.rms_norm_eps)

    def select(self, x: torch.Tensor, qr: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor,
               cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """→ (indices [n, k], valid [n, k]): the top-k visible entries of the N for each query."""
        n = x.shape[0]
        q = apply_rope(self.wq_b(qr).view(n, self.n_heads, self.head_dim), cos, sin)  # [n, hI, dI]
        logits = torch.einsum("nhc,sc->nhs", q.float(), keys).relu_()  # [n, hI, N]
        weights = self.weights_proj(x).float() * (self.n_heads**-0.5 * self.head_dim**-0.5)  # [n, hI]
        scores = torch.bmm(weights.unsqueeze(1), logits).squeeze(1)  # Σ_h w·relu(q·k) → [n, N]
        scores = scores.masked_fill(~visible, float("-inf"))
        k = min(self.topk, keys.shape[0])
        top = scores.topk(k, dim=-1).indices
        return top, visible.gather(1, top)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.layer_kind(layer)
        self.ratio = cfg.compress_ratios[layer]
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
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            self.compressor = Compressor(cfg.hidden_size, d, self.ratio, self.kind == "csa", cfg.rms_norm_eps)
        if self.kind == "csa":
            self.indexer = Indexer(cfg, self.ratio)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, kv_store: LayerKV, rotary: Rotary,
                cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, D]."""
        t = x.shape[0]
        qr = self.q_norm(self.wq_a(x))  # [T, q_lora]
        q = rms_unit(self.wq_b(qr).view(t, self.n_heads, self.head_dim), self.cfg.rms_norm_eps)
        q = apply_rope(q, cos, sin)  # [T, H, d]
        kv = apply_rope(self.kv_norm(self.wkv(x)), cos, sin)  # [T, d]
        out = torch.empty_like(q)
        for seq in meta.seqs:
            rows = slice(seq.offset, seq.offset + seq.num_new)
            out[rows] = self._attend_seq(x[rows], qr[rows], q[rows], kv[rows], seq, kv_store, rotary,
                                         cos[rows], sin[rows])
        out = apply_rope(out, cos, -sin)  # V = K carried RoPE; rotate it back at the query position
        groups = out.reshape(t, self.cfg.o_groups, -1)  # [T, G, H·d/G]
        wo_a = self.wo_a.weight.view(self.cfg.o_groups, self.cfg.o_lora_rank, -1)
        o = torch.einsum("tgi,goi->tgo", groups, wo_a).flatten(1)
        return self.wo_b(o)

    def _window_keys(self, kv: torch.Tensor, seq: SeqChunk, ring: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys for the window branch: ring rows for [start−W+1, start) then the new ones."""
        lo = max(seq.start - self.window + 1, seq.window_from, 0)
        old = torch.arange(lo, seq.start, device=kv.device)
        keys = torch.cat([ring[old % self.window].to(kv.dtype), kv])
        positions = torch.arange(lo, seq.end, device=kv.device)
        keep = min(seq.num_new, self.window)
        ring[torch.arange(seq.end - keep, seq.end, device=kv.device) % self.window] = kv[-keep:].to(ring.dtype)
        return keys, positions

    def _compressed(self, x: torch.Tensor, seq: SeqChunk, store: LayerKV, rotary: Rotary
                    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add this chunk's finished entries (and indexer keys) to the Block Cache and return all
        of the sequence's entries [N, d] and indexer keys [N, dI] (None without an indexer)."""
        assert self.compressor is not None and store.entries is not None
        slot, table = seq.slot, seq.block_table
        new, first = self.compressor(x, seq, store.pending_kv[slot], store.pending_score[slot], rotary)
        write_entries(store.entries, table, first, new)
        count = seq.end // self.ratio
        entries = read_entries(store.entries, table, count)
        if self.indexer is None:
            return entries, None
        assert store.index_keys is not None
        new_keys, first = self.indexer.compressor(
            x, seq, store.index_pending_kv[slot], store.index_pending_score[slot], rotary)
        write_entries(store.index_keys, table, first, new_keys)
        return entries, read_entries(store.index_keys, table, count)

    def _attend_seq(self, x: torch.Tensor, qr: torch.Tensor, q: torch.Tensor, kv: torch.Tensor,
                    seq: SeqChunk, store: LayerKV, rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor
                    ) -> torch.Tensor:
        keys, key_pos = self._window_keys(kv, seq, store.window[seq.slot])
        entries, index_keys = (None, None)
        if self.compressor is not None:
            entries, index_keys = self._compressed(x, seq, store, rotary)
        out = torch.empty_like(q)
        # Query tiles bound the window branch to O(n·(tile+W)) instead of O(n²) on long chunks.
        for a in range(0, seq.num_new, ATTN_TILE):
            b = min(a + ATTN_TILE, seq.num_new)
            positions = torch.arange(seq.start + a, seq.start + b, device=x.device)
            lo = max(int(positions[0]) - self.window + 1 - int(key_pos[0]), 0)
            hi = int(positions[-1]) + 1 - int(key_pos[0])
            dist = positions[:, None] - key_pos[None, lo:hi]
            shared, mask = keys[lo:hi], (dist >= 0) & (dist < self.window)  # [L], [t, L]
            picked, picked_mask = None, None
            if entries is not None:
                count = (seq.start + b) // self.ratio
                visible = torch.arange(count, device=x.device)[None, :] < ((positions + 1) // self.ratio)[:, None]
                if self.indexer is not None and index_keys is not None:
                    top, picked_mask = self.indexer.select(x[a:b], qr[a:b], index_keys[:count], visible,
                                                           cos[a:b], sin[a:b])
                    picked = entries[top]  # [t, k, d]
                else:
                    shared = torch.cat([shared, entries[:count].to(keys.dtype)])
                    mask = torch.cat([mask, visible], dim=1)
            out[a:b] = sparse_attention(q[a:b], shared, mask, picked, picked_mask, self.attn_sink,
                                        self.head_dim**-0.5)
        return out


# ---- mixture of experts ------------------------------------------------------------------------------


class Expert(nn.Module):
    def __init__(self, dim: int, inter: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, inter, bias=False)
        self.w2 = nn.Linear(inter, dim, bias=False)
        self.w3 = nn.Linear(dim, inter, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.w1(x), self.w3(x)
        if self.limit:
            gate, up = gate.clamp(max=self.limit), up.clamp(-self.limit, self.limit)
        return self.w2(F.silu(gate) * up)


class Gate(nn.Module):
    """Router: affinity scores choose experts (plus a selection-only bias), or on the first
    layers a fixed token→experts table (`tid2eid`) chooses them; scores still weight them."""

    def __init__(self, cfg: ModelConfig, hashed: bool) -> None:
        super().__init__()
        self.topk, self.func, self.scale = cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        self.hashed = hashed
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight.float())
        if self.func == "softmax":
            scores = logits.softmax(dim=-1)
        elif self.func == "sigmoid":
            scores = logits.sigmoid()
        else:
            scores = F.softplus(logits).sqrt()
        if self.hashed:
            indices = self.tid2eid[input_ids]
        else:
            indices = (scores + self.bias.float()).topk(self.topk, dim=-1, sorted=False).indices
        weights = scores.gather(1, indices)
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * self.scale, indices


class MoE(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.gate = Gate(cfg, hashed=layer < cfg.num_hash_layers)
        self.experts = nn.ModuleList(
            Expert(cfg.hidden_size, cfg.moe_intermediate_size, cfg.swiglu_limit)
            for _ in range(cfg.n_routed_experts))
        self.shared_experts = Expert(cfg.hidden_size, cfg.shared_intermediate_size, cfg.swiglu_limit)

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, indices = self.gate(x, input_ids)  # [T, k]
        out = torch.zeros_like(x)
        for e in indices.unique().tolist():
            token, which = torch.where(indices == e)
            y = self.experts[e](x[token]) * weights[token, which, None].to(x.dtype)
            out.index_add_(0, token, y)
        return out + self.shared_experts(x)


# ---- manifold-constrained hyper-connections -----------------------------------------------------------


def hc_weights(h: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor,
               cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """h [T, hc, D] → (pre [T, hc], post [T, hc], comb [T, hc, hc]); comb is Sinkhorn-projected
    onto doubly-stochastic matrices so the mixed residual cannot grow."""
    hc, eps = cfg.hc_mult, cfg.hc_eps
    mixes = F.linear(rms_unit(h.flatten(1).float(), cfg.rms_norm_eps), fn.float())
    pre_w, post_w, comb_w = mixes.split([hc, hc, hc * hc], dim=-1)
    pre_b, post_b, comb_b = base.float().split([hc, hc, hc * hc])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.unflatten(-1, (hc, hc)) * scale[2] + comb_b.view(hc, hc), dim=-1) + eps
    comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    for _ in range(cfg.hc_sinkhorn_iters - 1):
        comb = comb / (comb.sum(dim=-1, keepdim=True) + eps)
        comb = comb / (comb.sum(dim=-2, keepdim=True) + eps)
    return pre, post, comb


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.layer = layer
        self.attn = Attention(cfg, layer)
        self.ffn = MoE(cfg, layer)
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        hc, mix = cfg.hc_mult, (2 + cfg.hc_mult) * cfg.hc_mult
        for part in ("attn", "ffn"):
            self.register_parameter(f"hc_{part}_fn", nn.Parameter(torch.zeros(mix, hc * cfg.hidden_size)))
            self.register_parameter(f"hc_{part}_base", nn.Parameter(torch.zeros(mix)))
            self.register_parameter(f"hc_{part}_scale", nn.Parameter(torch.ones(3)))

    def _mixed(self, h: torch.Tensor, part: str, sublayer) -> torch.Tensor:
        pre, post, comb = hc_weights(h, getattr(self, f"hc_{part}_fn"), getattr(self, f"hc_{part}_base"),
                                     getattr(self, f"hc_{part}_scale"), self.cfg)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)  # [T, D]
        y = sublayer(collapsed)
        # new stream k = post_k · y + Σ_j comb[j, k] · h_j
        return post.to(h.dtype).unsqueeze(-1) * y.unsqueeze(1) + comb.to(h.dtype).transpose(-1, -2) @ h

    def forward(self, h: torch.Tensor, input_ids: torch.Tensor, meta: AttentionMetadata, store: LayerKV,
                rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = self._mixed(h, "attn", lambda x: self.attn(self.attn_norm(x), meta, store, rotary, cos, sin))
        return self._mixed(h, "ffn", lambda x: self.ffn(self.ffn_norm(x), input_ids))


class DeepseekV4(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.hc_head_fn = nn.Parameter(torch.zeros(cfg.hc_mult, cfg.hc_mult * cfg.hidden_size))
        self.hc_head_base = nn.Parameter(torch.zeros(cfg.hc_mult))
        self.hc_head_scale = nn.Parameter(torch.ones(1))
        # Window-only layers rotate with plain RoPE; compressed layers (and their compressors
        # and indexers) with the YaRN-scaled compress theta.
        self.rotary_main = Rotary(cfg.rope_dim, cfg.rope_theta, None)
        self.rotary_compress = Rotary(cfg.rope_dim, cfg.compress_rope_theta, cfg.yarn)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv: KVStorage,
                hidden_only: bool = False) -> torch.Tensor:
        """input_ids [T] (the new tokens of every sequence, flattened) → logits [R, V] for
        `meta.logits_rows` (fp32)."""
        positions = torch.cat([torch.arange(s.start, s.end) for s in meta.seqs]).to(input_ids.device)
        cs_main = self.rotary_main.cos_sin(positions)
        cs_comp = self.rotary_compress.cos_sin(positions)
        h = self.embed(input_ids).unsqueeze(1).expand(-1, self.cfg.hc_mult, -1).contiguous()
        for block, store in zip(self.layers, kv.layers, strict=True):
            rotary, (cos, sin) = ((self.rotary_main, cs_main) if block.attn.kind == "swa"
                                  else (self.rotary_compress, cs_comp))
            h = block(h, input_ids, meta, store, rotary, cos, sin)
        h = h[meta.logits_rows]
        x = self.norm(self._hc_head(h))
        if hidden_only:
            return x
        return F.linear(x.float(), self.head.weight.float())

    def _hc_head(self, h: torch.Tensor) -> torch.Tensor:
        eps = self.cfg.hc_eps
        mixes = F.linear(rms_unit(h.flatten(1).float(), self.cfg.rms_norm_eps), self.hc_head_fn.float())
        pre = torch.sigmoid(mixes * self.hc_head_scale.float() + self.hc_head_base.float()) + eps
        return (pre.unsqueeze(-1) * h).sum(dim=1).to(h.dtype)
