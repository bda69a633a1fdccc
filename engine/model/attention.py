"""DeepSeek-V4 attention: a sliding window on every layer, plus compressed entries on CSA layers
(overlapping m-token pooling, Lightning Indexer top-k) and HCA layers (m'-token pooling, all
visible entries). One softmax over every key with a per-head sink; K = V.

Shapes: n = one sequence's new tokens, D = sequences decoding one token each, H = heads,
d = head dim, m = compress ratio, N = compressed entries, k = indexer top-k.

Two paths compute the same thing: sequences with several new tokens (prefill chunks) go one by
one through query tiles; sequences decoding a single token go through one batched pass, since
per-sequence overhead is what bounds decode throughput.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from v4serve.cache.device_kv import LayerKV
from v4serve.engine.model.compressor import Compressor, Indexer
from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.layers import RMSNorm, Rotary, apply_rope, rms_unit
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.kernels.attention import sparse_attention
from v4serve.kernels.paged import (
    padded_tables,
    read_entries,
    read_entries_batched,
    ring_read,
    ring_write,
    ring_write_batched,
    write_entries,
)

# Queries per attention tile on long chunks: bounds the window branch to O(n·(tile+W)).
ATTN_TILE = 256


@dataclass
class _Projected:
    """Everything computed for the whole batch at once, sliced per sequence later."""

    x: torch.Tensor  # [T, D]
    q: torch.Tensor  # [T, H, d]
    kv: torch.Tensor  # [T, d]
    comp: tuple[torch.Tensor, torch.Tensor] | None = None  # compressor kv, score rows
    index_comp: tuple[torch.Tensor, torch.Tensor] | None = None
    index_q: tuple[torch.Tensor, torch.Tensor] | None = None  # indexer queries and head weights


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

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, layer_kv: LayerKV, rotary: Rotary,
                cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, D]."""
        t = x.shape[0]
        qr = self.q_norm(self.wq_a(x))  # [T, q_lora]
        q = rms_unit(self.wq_b(qr).view(t, self.n_heads, self.head_dim), self.cfg.rms_norm_eps)
        p = _Projected(x=x, q=apply_rope(q, cos, sin), kv=apply_rope(self.kv_norm(self.wkv(x)), cos, sin))
        if self.compressor is not None:
            p.comp = self.compressor.project(x, positions)
        if self.indexer is not None:
            p.index_comp = self.indexer.compressor.project(x, positions)
            p.index_q = self.indexer.queries(x, qr, cos, sin)
        out = torch.empty_like(p.q)
        decodes = [s for s in meta.seqs if s.num_new == 1]
        if decodes:
            rows = torch.tensor([s.offset for s in decodes], device=x.device)
            out[rows] = self._attend_decodes(p, decodes, rows, layer_kv, rotary)
        for seq in meta.seqs:
            if seq.num_new > 1:
                rows_ = slice(seq.offset, seq.offset + seq.num_new)
                out[rows_] = self._attend_chunk(p, seq, rows_, layer_kv, rotary)
        out = apply_rope(out, cos, -sin)  # V = K carried RoPE; rotate it back at the query position
        groups = out.reshape(t, self.cfg.o_groups, -1)  # [T, G, H·d/G]
        wo_a = self.wo_a.weight.view(self.cfg.o_groups, self.cfg.o_lora_rank, -1)
        return self.wo_b(torch.einsum("tgi,goi->tgo", groups, wo_a).flatten(1))

    # ---- prefill chunks: one sequence at a time, tiles of queries ---------------------------------------
    def _attend_chunk(self, p: _Projected, seq: SeqChunk, rows: slice, layer_kv: LayerKV, rotary: Rotary
                      ) -> torch.Tensor:
        q, kv = p.q[rows], p.kv[rows]
        keys, key_pos = self._window_keys(kv, seq, layer_kv.window[seq.slot])
        entries, index_keys = (None, None)
        if self.compressor is not None:
            entries, index_keys = self._chunk_entries(p, seq, rows, layer_kv, rotary)
        out = torch.empty_like(q)
        for a in range(0, seq.num_new, ATTN_TILE):
            b = min(a + ATTN_TILE, seq.num_new)
            positions = torch.arange(seq.start + a, seq.start + b, device=q.device)
            lo = max(int(positions[0]) - self.window + 1 - int(key_pos[0]), 0)
            hi = int(positions[-1]) + 1 - int(key_pos[0])
            dist = positions[:, None] - key_pos[None, lo:hi]
            shared, mask = keys[lo:hi], (dist >= 0) & (dist < self.window)  # [L, d], [t, L]
            picked, picked_mask = None, None
            if entries is not None:
                count = (seq.start + b) // self.ratio
                visible = torch.arange(count, device=q.device)[None, :] < ((positions + 1) // self.ratio)[:, None]
                if index_keys is not None and p.index_q is not None:
                    iq, iw = p.index_q[0][rows][a:b], p.index_q[1][rows][a:b]
                    top, valid = self.indexer.select(iq[None], iw[None], index_keys[None, :count], visible[None])
                    picked, picked_mask = entries[top[0]], valid[0]  # [t, k, d], [t, k]
                else:
                    shared = torch.cat([shared, entries[:count].to(keys.dtype)])
                    mask = torch.cat([mask, visible], dim=1)
            out[a:b] = sparse_attention(q[a:b], shared, mask, picked, picked_mask, self.attn_sink,
                                        self.head_dim**-0.5)
        return out

    def _window_keys(self, kv: torch.Tensor, seq: SeqChunk, ring: torch.Tensor
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys for the window branch: ring rows for [start−W+1, start) then the new ones."""
        lo = max(seq.start - self.window + 1, seq.window_from, 0)
        keys = torch.cat([ring_read(ring, torch.arange(lo, seq.start, device=kv.device)).to(kv.dtype), kv])
        ring_write(ring, seq.end, kv)
        return keys, torch.arange(lo, seq.end, device=kv.device)

    def _chunk_entries(self, p: _Projected, seq: SeqChunk, rows: slice, layer_kv: LayerKV, rotary: Rotary
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Add this chunk's finished entries (and indexer keys) to the Block Cache and return all
        of the sequence's entries [N, d] and indexer keys [N, dI] (None without an indexer)."""
        assert self.compressor is not None and layer_kv.entries is not None and p.comp is not None
        slot, table, count = seq.slot, seq.block_table, seq.end // self.ratio
        new, first = self.compressor.update(p.comp[0][rows], p.comp[1][rows], seq, layer_kv.pending_kv[slot],
                                            layer_kv.pending_score[slot], rotary)
        write_entries(layer_kv.entries, table, first, new)
        entries = read_entries(layer_kv.entries, table, count)
        if self.indexer is None:
            return entries, None
        assert layer_kv.index_keys is not None and p.index_comp is not None
        new, first = self.indexer.compressor.update(p.index_comp[0][rows], p.index_comp[1][rows], seq,
                                                    layer_kv.index_pending_kv[slot], layer_kv.index_pending_score[slot],
                                                    rotary)
        write_entries(layer_kv.index_keys, table, first, new)
        return entries, read_entries(layer_kv.index_keys, table, count)

    # ---- decodes: every sequence with one new token, in one batched pass ----------------------------------
    def _attend_decodes(self, p: _Projected, seqs: list[SeqChunk], rows: torch.Tensor, layer_kv: LayerKV,
                        rotary: Rotary) -> torch.Tensor:
        dev = rows.device
        slots = torch.tensor([s.slot for s in seqs], device=dev)
        t = torch.tensor([s.start for s in seqs], device=dev)
        keys, mask = self._decode_window(p.kv[rows], slots, t, seqs, layer_kv.window)
        picked, picked_mask = None, None
        if self.compressor is not None:
            entries, index_keys, visible = self._decode_entries(p, seqs, rows, slots, t, layer_kv, rotary)
            if entries is not None and index_keys is not None and p.index_q is not None:
                iq, iw = p.index_q[0][rows][:, None], p.index_q[1][rows][:, None]
                top, valid = self.indexer.select(iq, iw, index_keys, visible[:, None])
                top = top[:, 0]
                picked = entries.gather(1, top[..., None].expand(-1, -1, entries.shape[-1]))  # [D, k, d]
                picked_mask = valid[:, 0]
            elif entries is not None:
                keys = torch.cat([keys, entries.to(keys.dtype)], dim=1)
                mask = torch.cat([mask, visible], dim=1)
        # Every decoding sequence has its own keys: pass them as "picked" keys of each query.
        if picked is not None:
            keys, mask = torch.cat([keys, picked.to(keys.dtype)], 1), torch.cat([mask, picked_mask], 1)
        q = p.q[rows]
        return sparse_attention(q, q.new_zeros(0, self.head_dim), mask.new_zeros(len(seqs), 0), keys, mask,
                                self.attn_sink, self.head_dim**-0.5)

    def _decode_window(self, kv: torch.Tensor, slots: torch.Tensor, t: torch.Tensor, seqs: list[SeqChunk],
                       window: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write each new window key, then read every slot's whole ring → keys [D, W, d] and which
        rows hold a position inside the window [D, W]."""
        w = self.window
        ring_write_batched(window, slots, t, kv)
        keys = window[slots].to(kv.dtype)
        row = torch.arange(w, device=kv.device)
        pos = t[:, None] - ((t[:, None] - row[None, :]) % w)  # position held by each ring row
        floor = torch.tensor([max(s.window_from, 0) for s in seqs], device=kv.device)
        return keys, pos >= floor[:, None]

    def _decode_entries(self, p: _Projected, seqs: list[SeqChunk], rows: torch.Tensor, slots: torch.Tensor,
                        t: torch.Tensor, layer_kv: LayerKV, rotary: Rotary
                        ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor]:
        """Update compressors, write finished entries, and gather every sequence's entries
        [D, N, d] (N = the most any sequence has), indexer keys [D, N, dI] and visibility [D, N]."""
        assert self.compressor is not None and layer_kv.entries is not None and p.comp is not None
        frozen = torch.tensor([s.frozen_until for s in seqs], device=t.device)
        new, which = self.compressor.decode_update(p.comp[0][rows], p.comp[1][rows], slots, t, frozen,
                                                   layer_kv.pending_kv, layer_kv.pending_score, rotary)
        self._write_decoded(layer_kv.entries, seqs, t, which, new)
        if self.indexer is not None:
            assert layer_kv.index_keys is not None and p.index_comp is not None
            new, which = self.indexer.compressor.decode_update(
                p.index_comp[0][rows], p.index_comp[1][rows], slots, t, frozen, layer_kv.index_pending_kv,
                layer_kv.index_pending_score, rotary)
            self._write_decoded(layer_kv.index_keys, seqs, t, which, new)
        counts = (t + 1) // self.ratio
        n = int(counts.max())
        visible = torch.arange(n, device=t.device)[None, :] < counts[:, None]
        if n == 0:
            return None, None, visible
        per_block = layer_kv.entries.shape[1]
        nb = -(-n // per_block)
        tables = padded_tables([s.block_table for s in seqs], nb, t.device)
        entries = read_entries_batched(layer_kv.entries, tables, n)
        index_keys = read_entries_batched(layer_kv.index_keys, tables, n) if layer_kv.index_keys is not None else None
        return entries, index_keys, visible

    def _write_decoded(self, dest: torch.Tensor, seqs: list[SeqChunk], t: torch.Tensor, which: torch.Tensor,
                       entries: torch.Tensor) -> None:
        for j, e in zip(which.tolist(), entries, strict=True):
            write_entries(dest, seqs[j].block_table, int(t[j] + 1) // self.ratio - 1, e[None])
