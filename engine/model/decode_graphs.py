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

Steps with prefill chunks run eagerly (their shapes vary with the chunk)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.model import DeepseekV4
from v4serve.kernels.attention import RaggedBatch, SlotTables, upload

log = logging.getLogger(__name__)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a graph of their own: 1, 2, 4, 8, then every 8 up to max_num_seqs (a step
    runs in the smallest bucket that holds it, its extra rows wasted)."""
    sizes = {b for b in (1, 2, 4) if b < max_num_seqs} | set(range(8, max_num_seqs, 8)) | {max_num_seqs}
    return tuple(sorted(sizes))


@dataclass
class _Bucket:
    size: int
    ids: torch.Tensor  # [size] token ids
    meta: AttentionMetadata  # the scratch rows' metadata: what the forward's Python side sees
    batch: RaggedBatch  # its tensors, refilled each step
    graph: torch.cuda.CUDAGraph | None = None
    logits: torch.Tensor | None = None  # the captured step's output, rewritten by each replay


class DecodeGraphs:
    def __init__(self, model: DeepseekV4, kv: DeviceKV, buckets: tuple[int, ...], table_width: int,
                 scratch_slot: int, scratch_block: int, capture: bool, slot_tables: SlotTables | None = None) -> None:
        """`slot_tables`: the slots' block tables on the device, which the engine keeps up to date with
        each step's sequences (None: each step sends its tables)."""
        self.model, self.kv = model, kv
        self.table_width = table_width
        self.scratch_slot, self.scratch_block = scratch_slot, scratch_block
        self.scratch_table = [scratch_block]  # one list: the scratch slot's row never changes
        self.slot_tables = slot_tables
        self.device = kv.device
        self.buckets = {b: self._bucket(b) for b in buckets}
        self.captured = False
        if capture:
            self._capture()

    def _scratch(self, n: int) -> list[SeqChunk]:
        return [SeqChunk(slot=self.scratch_slot, block_table=self.scratch_table, start=0, num_new=1)
                for _ in range(n)]

    def _bucket(self, size: int) -> _Bucket:
        meta = AttentionMetadata.build(self._scratch(size))
        meta.table_width = self.table_width
        if self.slot_tables is not None:
            self.slot_tables.update([self.scratch_slot], [self.scratch_table])
            meta.slot_tables = self.slot_tables
        return _Bucket(size, torch.zeros(size, dtype=torch.long, device=self.device), meta,
                       meta.ragged(self.device))

    def fits(self, seqs: list[SeqChunk]) -> bool:
        """A decode-only step these buckets can run."""
        return (0 < len(seqs) <= max(self.buckets) and all(s.num_new == 1 for s in seqs)
                and all(len(s.block_table) <= self.table_width for s in seqs))

    def run(self, ids: list[int], seqs: list[SeqChunk],
            fill: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
        """One decode step of `seqs` (one new token each, `ids`; `fill` then writes into the bucket's
        ids the tokens still on the device) → logits [len(seqs), V], a view of the bucket's output:
        read it before the next step."""
        bucket = self.buckets[min(b for b in self.buckets if b >= len(seqs))]
        padded = seqs + self._scratch(bucket.size - len(seqs))
        bucket.batch.refill([s.slot for s in padded], [s.start for s in padded], [s.window_from for s in padded],
                            [s.block_table for s in padded], [s.frozen_until for s in padded])
        upload(ids + [0] * (bucket.size - len(ids)), self.device, out=bucket.ids)
        if fill is not None:
            fill(bucket.ids)
        if bucket.graph is not None:
            bucket.graph.replay()
            assert bucket.logits is not None
            return bucket.logits[:len(seqs)]
        return self._forward(bucket)[:len(seqs)]

    def _forward(self, bucket: _Bucket) -> torch.Tensor:
        return self.model(bucket.ids, bucket.meta, self.kv, batch=bucket.batch)

    def _capture(self) -> None:
        """Each bucket, largest first (the smaller ones then fit in the memory pool it leaves), run
        twice on a side stream (Triton compiles, the allocator settles), then captured. The scratch
        rows are all the capture writes."""
        pool = None
        log.info("capturing CUDA graphs for decode batches of %s (--enforce-eager skips this)",
                 ", ".join(map(str, sorted(self.buckets))))
        for size in sorted(self.buckets, reverse=True):
            bucket = self.buckets[size]
            stream = torch.cuda.Stream(self.device)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bucket)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                bucket.logits = self._forward(bucket)
            bucket.graph, pool = graph, graph.pool()
        torch.cuda.synchronize(self.device)
        self.captured = True
        log.info("CUDA graphs captured: %d buckets", len(self.buckets))
