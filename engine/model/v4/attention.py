"""DeepSeek-V4 attention: a sliding window on every layer, plus compressed entries on CSA layers
(overlapping m-token pooling, Lightning Indexer top-k) and HCA layers (m'-token pooling, all
visible entries). One softmax over every key with a per-head sink; K = V.

Shapes: n = one sequence's new tokens, D = sequences decoding one token each, H = heads,
d = head dim, m = compress ratio, N = compressed entries, k = indexer top-k.

Per layer: project; feed the compressors and write the entries they finish (Block Cache); pick
the indexer's top-k; attend (`kernels.sparse_attention`, over the whole ragged batch); then store
the new window keys in the State Cache rings. A step of decodes only does all of its writes first,
in one call (`kernels.write_decode_step`). Host-side loops here treat decoding sequences in one
batched pass, since per-sequence overhead is what bounds decode throughput.

Under tensor parallelism (engine/model/parallel/sharding.py) a rank holds H/N heads and o_groups/N output
groups; the KV (one latent head) and everything before `wq_b` are whole on every rank, and the
output projection's partial sums are all-reduced.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn

from v4serve.cache.device_kv import LayerKV
from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.layers import RMSNorm, Rotary, SharedInput
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.parallel.sharding import ParallelConfig, all_reduce_sum
from v4serve.engine.model.v4.compressor import Compressor, Indexer
from v4serve.engine.model.weights.packed import weight_of
from v4serve.kernels.attention import ATTN_TILE, RaggedBatch
from v4serve.kernels.cpu_threads import run_pieces
from v4serve.kernels.decode_writes import Compression
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.paged import read_entries
from v4serve.kernels.registry import load_kernels

SCORE_BUDGET = 1 << 24  # indexer scores per tile of chunk rows (64 MiB of fp32)
# A prefill chunk's indexer tiles go to the CPU's threads whole once a tile holds this many per-head
# logits (8 heads: entries from 4,096, a 16K context). Whole tiles took 1.3-1.8x the time of per-op
# threads at 128-1,024 entries, 1.01x at 2,048 and 0.88x from 4,096 (2-core machine, tiny model).
THREADED_TILE_LOGITS = 1 << 23


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, parallel: ParallelConfig | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.kind = cfg.layer_kind(layer)
        self.ratio = cfg.ratio(layer)
        ranks = parallel.size if parallel is not None else 1
        h, d = cfg.num_heads // ranks, cfg.head_dim  # this rank's heads
        self.n_heads, self.head_dim, self.window = h, d, cfg.window
        self.o_groups = cfg.o_groups // ranks  # this rank's output groups (each H/G heads wide)
        self.wq_a = nn.Linear(cfg.hidden_size, cfg.q_lora_rank, bias=False)
        self.q_norm = RMSNorm(cfg.q_lora_rank, cfg.rms_norm_eps)
        self.wq_b = nn.Linear(cfg.q_lora_rank, h * d, bias=False)
        self.wkv = nn.Linear(cfg.hidden_size, d, bias=False)
        self.kv_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.wo_a = nn.Linear(cfg.num_heads * d // cfg.o_groups, self.o_groups * cfg.o_lora_rank, bias=False)
        self.wo_b = nn.Linear(self.o_groups * cfg.o_lora_rank, cfg.hidden_size, bias=False)
        self.attn_sink = nn.Parameter(torch.zeros(h))
        self.reduce = all_reduce_sum if ranks > 1 else None  # wo_b's partial sums over the ranks' groups
        self.kernels = load_kernels("torch")
        self.compressor: Compressor | None = None
        self.indexer: Indexer | None = None
        if self.ratio:
            self.compressor = Compressor(cfg.hidden_size, d, self.ratio, self.kind == "csa", cfg.rms_norm_eps)
        if self.kind == "csa":
            self.indexer = Indexer(cfg, self.ratio, parallel)
        # Projections of the same input, one GEMM each once fused (`fuse_projections`).
        self.x_inputs = SharedInput([self.wq_a, self.wkv, *(self.compressor.inputs() if self.compressor else []),
                                     *(self.indexer.inputs() if self.indexer else [])])
        self.qr_inputs = SharedInput([self.wq_b, *([self.indexer.wq_b] if self.indexer else [])])

    def fuse_projections(self) -> None:
        self.x_inputs.fuse()
        self.qr_inputs.fuse()

    def forward(self, x: torch.Tensor, meta: AttentionMetadata, batch: RaggedBatch, layer_kv: LayerKV,
                rotary: Rotary, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, D] → [T, D]."""
        t, k, eps = x.shape[0], self.kernels, self.cfg.rms_norm_eps
        of_x = self.x_inputs(x, k.linear)
        qr = k.rms_norm(of_x[self.wq_a], self.q_norm.weight, eps)  # [T, q_lora]
        of_x |= self.qr_inputs(qr, k.linear)
        q = k.rms_norm_rope(of_x[self.wq_b].view(t, self.n_heads, self.head_dim), None, eps, cos, sin)  # [T, H, d]
        kv = k.rms_norm_rope(of_x[self.wkv], self.kv_norm.weight, eps, cos, sin)  # [T, d]
        record = layer_kv.layout.record
        if record is not None:
            # FP8 keys: this step's keys are rounded as they will be stored, so a key read back from
            # the cache later (a prefix hit, the next chunk) equals the one used now.
            kv = k.round_keys(kv, record)
        compressions = self._compressions(of_x, layer_kv, record)
        if meta.capture is not None:
            assert batch.rows is None, "a row-wise step keeps no slot states"
            meta.capture.keep(layer_kv, kv, compressions)
        if batch.rows is not None:
            self._compress_rows(compressions, batch, rotary)
        elif batch.only_decodes:
            # All of the layer's writes in one call, before anything reads them (decode_writes.py).
            k.write_decode_step(layer_kv.window, kv, batch, record, compressions, rotary.inv_freq)
        else:
            for c in compressions:
                self._compress(c, meta, batch, rotary)
        topk = None
        if self.indexer is not None:
            assert layer_kv.index_keys is not None
            topk = self._select(self.indexer.queries(of_x, cos, sin, k.rope), meta, batch, layer_kv.index_keys)
        out = k.sparse_attention(q, kv, layer_kv.window, layer_kv.entries, topk, batch, self.ratio,
                                 self.attn_sink, self.head_dim**-0.5, record)
        if not batch.only_decodes:  # after attention: a chunk replaces rows it reads
            k.write_window(layer_kv.window, kv, batch if batch.rows is None else batch.rows.targets, record)
        out = k.rope(out, cos, sin, inverse=True, out=q)  # V = K carried RoPE: rotate back; q is dead by now
        groups = out.reshape(t, self.o_groups, -1)  # [T, G, H·d/G]
        wo_a = weight_of(self.wo_a)
        if isinstance(wo_a, torch.Tensor):
            wo_a = wo_a.view(self.o_groups, self.cfg.o_lora_rank, -1)  # [G, O, H·d/G]
        out = k.linear(k.grouped_linear(groups, wo_a).flatten(1), weight_of(self.wo_b))  # [T, D]
        return out if self.reduce is None else self.reduce(out)

    # ---- compressed entries ----------------------------------------------------------------------------
    def _compressions(self, of_x: dict[nn.Linear, torch.Tensor], layer_kv: LayerKV,
                      record: Record | None) -> list[Compression]:
        """This layer's compressors with their step rows, pending rings and destination: its own
        (entries; FP8 records under `record`) and its indexer's (indexer keys)."""
        parts = []
        if self.compressor is not None:
            assert layer_kv.entries is not None and layer_kv.pending_kv is not None
            parts.append(self._compression(self.compressor, of_x, layer_kv.pending_kv, layer_kv.pending_score,
                                           layer_kv.entries, record))
        if self.indexer is not None:
            assert layer_kv.index_keys is not None and layer_kv.index_pending_kv is not None
            parts.append(self._compression(self.indexer.compressor, of_x, layer_kv.index_pending_kv,
                                           layer_kv.index_pending_score, layer_kv.index_keys, None))
        return parts

    @staticmethod
    def _compression(compressor: Compressor, of_x: dict[nn.Linear, torch.Tensor], pending_kv: torch.Tensor,
                     pending_score: torch.Tensor, dest: torch.Tensor, record: Record | None) -> Compression:
        comp_kv, comp_score = compressor.project(of_x)
        return Compression(comp_kv, comp_score, pending_kv, pending_score, dest, compressor.ratio, compressor.overlap,
                           compressor.norm.weight, compressor.norm.eps, compressor.ape, record)

    def _compress(self, c: Compression, meta: AttentionMetadata, batch: RaggedBatch, rotary: Rotary) -> None:
        """Feed a step with prefill chunks to a compressor: its decodes' rows, then each chunk; the
        entries they finish go to the Block Cache before attention reads them."""
        dec = batch.decodes
        if dec.seqs:
            self.kernels.compress_decodes(batch.decode_rows(c.kv), batch.decode_rows(c.score), c.ring_kv,
                                          c.ring_score, dec.slots, dec.positions, dec.frozen_until, dec.tables,
                                          c.dest, c.ratio, c.overlap, c.norm_weight, c.eps, rotary.inv_freq, c.ape,
                                          c.record)
        for b, seq in enumerate(meta.seqs):
            if seq.num_new > 1:
                rows = slice(seq.offset, seq.offset + seq.num_new)
                self.kernels.compress_chunk(c.kv[rows], c.score[rows], c.ring_kv[seq.slot], c.ring_score[seq.slot],
                                            seq.start, seq.frozen_until, batch.tables[b], c.dest, c.ratio, c.overlap,
                                            c.norm_weight, c.eps, rotary.inv_freq, c.ape, c.record)

    def _compress_rows(self, compressions: list[Compression], batch: RaggedBatch, rotary: Rotary) -> None:
        """A row-wise step's compressor rows in rounds, each sequence's j-th row in round j: a slot's
        pending rows are then written in order, and an entry is pooled once the rows before it are in."""
        for j, rows in enumerate(batch.rows.rounds if batch.rows is not None else ()):
            if not len(rows):
                continue
            to = batch.round_targets(j)
            for c in compressions:
                self.kernels.compress_decodes(c.kv.index_select(0, rows), c.score.index_select(0, rows), c.ring_kv,
                                              c.ring_score, to.slots, to.positions, to.frozen_until, to.tables,
                                              c.dest, c.ratio, c.overlap, c.norm_weight, c.eps, rotary.inv_freq,
                                              c.ape, c.record)

    def _select(self, index_q: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata, batch: RaggedBatch,
                index_keys: torch.Tensor) -> torch.Tensor:
        """The indexer's top-k CSA entries of every query → topk [T, k] (−1 where fewer are visible)."""
        assert self.indexer is not None
        iq, iw = index_q
        dec = batch.decodes
        visible = [(batch.starts[b] + 1) // self.ratio for b in dec.seqs]  # known on the host: no sync
        # Entries scored per row: those the longest row sees, or, at a fixed table width, all a table
        # can address (the step's shapes then do not depend on the contexts).
        fixed = meta.table_width is not None
        if batch.rows is not None:  # every row as a decode
            visible = [(s + n) // self.ratio for s, n in zip(batch.starts, batch.num_new, strict=True)]
        n = dec.tables.shape[1] * index_keys.shape[1] if fixed else max(visible + [0])
        if batch.rows is not None:
            if not n:
                return torch.full((iq.shape[0], self.indexer.topk), -1, dtype=torch.long, device=iq.device)
            return self._top_entries(iq, iw, index_keys, dec.tables, batch.entry_counts(self.ratio), n)
        if batch.only_decodes and n:
            # Every row is a decode: its k-wide top-k (−1 past its count) is the answer, nothing to
            # scatter; `full` when each row is known to see k entries (nothing to pad either).
            full = not fixed and min(visible) >= self.indexer.topk
            return self._top_entries(iq, iw, index_keys, dec.tables, batch.entry_counts(self.ratio), n, full=full)
        topk = torch.full((iq.shape[0], self.indexer.topk), -1, dtype=torch.long, device=iq.device)
        if n:
            top = self._top_entries(batch.decode_rows(iq), batch.decode_rows(iw), index_keys, dec.tables,
                                    batch.entry_counts(self.ratio), n)
            topk[dec.rows, :top.shape[-1]] = top
        # The Triton kernel reads each row's keys through its block table, so a chunk's rows go
        # through it as decodes do; the torch twin would gather [rows, n, dI] keys, so there a
        # chunk's tiles share theirs (unless per-row scores are asked for: --batch-invariant).
        per_row = self.kernels.batch_invariant or self.kernels.paged_index_scores
        for b, seq in enumerate(meta.seqs):
            if seq.num_new > 1 and per_row:
                self._select_chunk_rows(iq, iw, seq, batch.tables[b], index_keys, topk)
            elif seq.num_new > 1:
                self._select_chunk(iq, iw, seq, index_keys, topk)
        return topk

    def _top_entries(self, iq: torch.Tensor, iw: torch.Tensor, index_keys: torch.Tensor, tables: torch.Tensor,
                     counts: torch.Tensor, n: int, full: bool = False) -> torch.Tensor:
        """Top-k of R queries by `kernels.index_scores` and `kernels.index_topk` → [R, k] (−1 past
        each one's count; `full`: each sees at least k). Always k wide, however few entries exist
        yet: the shapes (and the Triton kernel's constants) stay those of every later step."""
        assert self.indexer is not None
        scores = self.indexer.summed(self.kernels.index_scores(iq, iw, index_keys, tables, counts, n,
                                                               self.indexer.w_scale))
        return self.kernels.index_topk(scores, counts, self.indexer.topk, full)

    def _select_chunk_rows(self, iq: torch.Tensor, iw: torch.Tensor, seq: SeqChunk, table: torch.Tensor,
                           index_keys: torch.Tensor, topk: torch.Tensor) -> None:
        """Top-k for a prefill chunk by the decode path's per-row scores: a position gets the same
        entries whether it came as a decode or inside any chunk. Rows go in tiles of at most
        SCORE_BUDGET scores (the [rows, n] score matrix of a long chunk at a long context would not
        fit); every row of a tile reads the one block table (expanded, not copied)."""
        n = seq.end // self.ratio
        if n == 0:
            return
        tile = max(1, SCORE_BUDGET // n)
        for a in range(0, seq.num_new, tile):
            z = min(a + tile, seq.num_new)
            seen = (seq.start + z) // self.ratio  # entries the tile's last row sees
            if seen == 0:
                continue  # its rows keep −1
            rows = slice(seq.offset + a, seq.offset + z)
            counts = (torch.arange(seq.start + a, seq.start + z, device=iq.device) + 1) // self.ratio
            top = self._top_entries(iq[rows], iw[rows], index_keys, table[None].expand(z - a, -1), counts, seen)
            topk[rows, :top.shape[-1]] = top

    def _select_chunk(self, iq: torch.Tensor, iw: torch.Tensor, seq: SeqChunk, index_keys: torch.Tensor,
                      topk: torch.Tensor) -> None:
        """Top-k for one prefill chunk, in tiles of queries sharing one gather of the keys (the
        scores are [tile, N]). On a CPU, at long contexts, the tiles go to the intra-op threads whole
        (`run_pieces`): there an op split over the threads costs more in waiting than it gains."""
        assert self.indexer is not None
        count = seq.end // self.ratio
        if count == 0:
            return
        keys = read_entries(index_keys, seq.block_table, count)
        indexer = self.indexer

        def pick(a: int, z: int) -> None:
            n = (seq.start + z) // self.ratio
            if n == 0:
                return
            rows = slice(seq.offset + a, seq.offset + z)
            counts = (torch.arange(seq.start + a, seq.start + z, device=iq.device) + 1) // self.ratio
            scores = indexer.scores(iq[rows], iw[rows], keys[:n], counts, (seq.start + a + 1) // self.ratio)
            top = self.kernels.index_topk(scores, counts, indexer.topk)
            topk[rows, :top.shape[-1]] = top

        tiles = [(a, min(a + ATTN_TILE, seq.num_new)) for a in range(0, seq.num_new, ATTN_TILE)]
        # Not under tensor parallelism: the ranks must all-reduce their tiles' scores in one order.
        if (iq.device.type == "cpu" and indexer.reduce is None
                and ATTN_TILE * count * indexer.n_heads >= THREADED_TILE_LOGITS):
            run_pieces([partial(pick, a, z) for a, z in tiles])
        else:
            for a, z in tiles:
                pick(a, z)
