"""Decode-only steps from static buffers, one set per batch-size bucket: captured once as CUDA graphs
and replayed on CUDA; run eagerly from the same buffers elsewhere, which is how the CPU tests check
that a replay computes what the eager step does.

A bucket's step must be the same work whatever its sequences are (tests/test_fixed_shapes.py):
- the batch is padded to the bucket with rows that decode position 0 of a scratch State Cache slot
  into a scratch block, neither ever handed to a request (the engine allocates one of each past
  the pools);
- every block table is padded to `table_width` blocks (those of max_model_len), so the indexer
  scores as many entries at any context;
- the step's metadata and token ids are copied into buffers the bucket owns, and the forward runs
  with the bucket's own `RaggedBatch` and `AttentionMetadata` (built once, for the scratch rows):
  Python-side values from the capture are what a replay keeps, so the eager run uses them too.

A drafted pass (speculative decoding: each sequence's last token and its drafts, a few rows each)
runs row-wise (kernels/attention.py `RowWrites`) in buckets of its own, `row_width` rows per sequence:
a sequence with fewer rows (no drafts this step, or a recompute after a rejected one) is padded with
rows that write only the scratch slot. Other steps with prefill chunks run eagerly (their shapes vary
with the chunk)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.kernels.attention import RaggedBatch, RowLayout, SlotTables, upload

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph of their own: 1, 2, 4, 8, then every 8 up to max_num_seqs (a step
    runs in the smallest bucket that holds it, its extra rows wasted)."""
    sizes = {b for b in (1, 2, 4) if b < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


@dataclass
class _Bucket:
    size: int  # sequences
    width: int  # rows per sequence: 1 (decodes), or a drafted pass's (row-wise)
    ids: torch.Tensor  # [size · width] token ids
    h: torch.Tensor | None  # [size · width, hc, D] the MTP layer's input states (None for the main model)
    meta: AttentionMetadata  # the scratch rows' metadata: what the forward's Python side sees
    batch: RaggedBatch  # its tensors, refilled each step
    graph: torch.cuda.CUDAGraph | None = None
    # The captured step's outputs, rewritten by each replay: logits [size · width, V] and the rows'
    # last states (what the MTP layer reads; None unless asked for).
    logits: torch.Tensor | None = None
    states: torch.Tensor | None = None


@dataclass
class StaticStep:
    """A static step's outputs (views of its bucket's buffers: read them before the next step): the
    logits of the rows asked for and, for the MTP layer, every row's last state and token with each
    sequence's first row (rows of a row-wise bucket are `width` apart)."""

    logits: torch.Tensor
    states: torch.Tensor | None
    ids: torch.Tensor
    offsets: list[int]


class DecodeGraphs:
    def __init__(self, model: DeepseekV4, kv: DeviceKV, buckets: tuple[int, ...], table_width: int,
                 scratch_slot: int, scratch_block: int, capture: bool, slot_tables: SlotTables | None = None,
                 row_width: int = 1, states: bool = False, mtp: bool = False) -> None:
        """`slot_tables`: the slots' block tables on the device, which the engine keeps up to date with
        each step's sequences (None: each step sends its tables). `row_width` > 1: drafted passes of
        that many rows per sequence get buckets too. `states`: keep every row's last state (MTP).
        `mtp`: the steps are the multi-token-prediction layer's (engine/mtp.py), whose inputs are states
        as well as tokens."""
        self.mtp = mtp
        self.model, self.kv = model, kv
        self.table_width = table_width
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.scratch_table = [scratch_block]  # one list: the scratch slot's row never changes
        self.slot_tables = slot_tables
        self.device = kv.device
        self.row_width, self.keep_states = row_width, states
        widths = (1, row_width) if row_width > 1 else (1,)
        self.buckets = {(b, w): self._bucket(b, w) for w in widths for b in buckets}
        self.sizes = tuple(sorted(buckets))
        self.captured = False
        self.runs = 0  # steps run from the buckets
        if capture:
            self._capture()

    def _scratch(self, n: int, width: int = 1) -> list[SeqChunk]:
        return [SeqChunk(slot=self.scratch_slot, block_table=self.scratch_table, start=0, num_new=width)
                for _ in range(n)]

    def _layout(self, padding: list[int], width: int) -> RowLayout | None:
        return RowLayout(width, tuple(padding), self.scratch_slot, self.scratch_block) if width > 1 else None

    def _bucket(self, size: int, width: int) -> _Bucket:
        # A drafted pass wants every row's logits; the MTP layer's multi-row passes (what it takes of kept
        # rows) want none, so their buckets skip the head.
        wanted = None if width == 1 else [range(0 if self.mtp else width)] * size
        meta = AttentionMetadata.build(self._scratch(size, width), wanted)
        meta.table_width = self.table_width
        meta.rowwise = self._layout([width] * size, width)
        if self.slot_tables is not None:
            self.slot_tables.update([self.scratch_slot], [self.scratch_table])
            meta.slot_tables = self.slot_tables
        cfg, rows = self.model.cfg, size * width
        h = (torch.zeros(rows, cfg.hc_mult, cfg.hidden_size, dtype=self.model.embed.weight.dtype, device=self.device)
             if self.mtp else None)
        return _Bucket(size, width, torch.zeros(rows, dtype=torch.long, device=self.device), h, meta,
                       meta.ragged(self.device))

    def width_for(self, seqs: list[SeqChunk]) -> int:
        """The rows per sequence of the buckets that can run these sequences' step: 1 for decodes, the
        row width for a drafted pass; 0 if none can."""
        if not 0 < len(seqs) <= self.sizes[-1] or any(len(s.block_table) > self.table_width for s in seqs):
            return 0
        most = max(s.num_new for s in seqs)
        return 1 if most == 1 else self.row_width if most <= self.row_width else 0

    def fits(self, seqs: list[SeqChunk]) -> bool:
        return self.width_for(seqs) > 0

    def run(self, ids: list[int] | torch.Tensor, seqs: list[SeqChunk],
            fill: Callable[[torch.Tensor], None] | None = None, logit_rows: list[range] | None = None,
            h: torch.Tensor | None = None) -> StaticStep:
        """One step of `seqs` from its bucket (`ids` their new tokens, flattened, from the host or on
        the device; `fill` then writes into the bucket's ids the tokens still on the device;
        `logit_rows`: each sequence's rows whose logits are wanted, counted from its first, default its
        last; `h`: the MTP layer's input states, flattened as `ids`) → its outputs, views of the bucket's."""
        width = self.width_for(seqs)
        assert width, "a step no bucket can run"
        self.runs += 1
        bucket = self.buckets[(min(b for b in self.sizes if b >= len(seqs)), width)]
        padded = seqs + self._scratch(bucket.size - len(seqs), width)
        padding = [width - s.num_new for s in seqs] + [width] * (bucket.size - len(seqs))
        bucket.batch.refill([s.slot for s in padded], [s.start for s in padded], [s.window_from for s in padded],
                            [s.block_table for s in padded], [s.frozen_until for s in padded],
                            self._layout(padding, width))
        if isinstance(ids, torch.Tensor):  # on the device (the MTP layer's inputs): each row into its place
            places = upload([i * width + j for i, s in enumerate(seqs) for j in range(s.num_new)], self.device)
            bucket.ids.index_copy_(0, places, ids)
            if h is not None:
                assert bucket.h is not None
                bucket.h.index_copy_(0, places, h.to(bucket.h.dtype))
        elif width == 1:  # decodes: the batch's padding rows go last
            upload(ids + [0] * (bucket.size - len(ids)), self.device, out=bucket.ids)
        else:
            padded_ids, at = [], 0
            for pad in padding:
                real = width - pad
                padded_ids += ids[at:at + real] + [0] * pad
                at += real
            upload(padded_ids, self.device, out=bucket.ids)
        if fill is not None:
            fill(bucket.ids)
        if bucket.graph is not None:
            bucket.graph.replay()
        else:
            bucket.logits, bucket.states = self._forward(bucket)
        assert bucket.logits is not None
        offsets = list(range(0, len(seqs) * width, width))
        if logit_rows is None and width == 1:  # a decode step's one row each: no index to build
            return StaticStep(bucket.logits[:len(seqs)], bucket.states, bucket.ids, offsets)
        wanted = [range(s.num_new - 1, s.num_new) for s in seqs] if logit_rows is None else logit_rows
        rows = [o + j for o, part in zip(offsets, wanted, strict=True) for j in part]
        assert not (rows and self.mtp and width > 1), "the MTP layer's multi-row buckets compute no logits"
        logits = (bucket.logits[:len(rows)] if rows == list(range(len(rows)))
                  else bucket.logits.index_select(0, upload(rows, self.device)))
        return StaticStep(logits, bucket.states, bucket.ids, offsets)

    def _forward(self, bucket: _Bucket) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self.mtp:
            assert bucket.h is not None
            return self.model.forward_mtp(bucket.h, bucket.ids, bucket.meta, self.kv, batch=bucket.batch)
        if self.keep_states:
            return self.model.forward_states(bucket.ids, bucket.meta, self.kv, batch=bucket.batch)
        return self.model(bucket.ids, bucket.meta, self.kv, batch=bucket.batch), None

    def _capture(self) -> None:
        """Each bucket, largest first (the smaller ones then fit in the memory pool it leaves), run
        twice on a side stream (Triton compiles, the allocator settles), then captured. The scratch
        rows are all the capture writes."""
        pool = None
        log.info("capturing CUDA graphs for decode batches of %s%s (--enforce-eager skips this)",
                 ", ".join(map(str, self.sizes)),
                 f", and drafted passes of {self.row_width} rows per sequence" if self.row_width > 1 else "")
        for key in sorted(self.buckets, key=lambda k: k[0] * k[1], reverse=True):
            bucket = self.buckets[key]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                bucket.logits, bucket.states = self._forward(bucket)
            bucket.graph, pool = graph, graph.pool()
        torch.cuda.synchronize(self.device)
        self.captured = True
        log.info("CUDA graphs captured: %d buckets", len(self.buckets))
