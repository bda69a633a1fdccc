"""One layer's cache writes in a step where every sequence decodes one token, as one call (one
launch in `decode_writes_triton`, the Triton twin, same signature): each sequence's key into its
window ring, then each compressor's new pending row and any entry it completes.

It runs before attention. That is safe for decodes: a decode query reads its own key from the
step's keys, and the ring row that key replaces held position p − W, outside its window. A
prefill chunk's window rows, by contrast, replace rows its earlier queries still read, so steps
with chunks write the window after attention (`paged.write_window`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from v4serve.kernels.compressor import Pooling, compress_decodes, pool
from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.paged import write_window

if TYPE_CHECKING:
    from v4serve.kernels.attention import RaggedBatch


@dataclass(frozen=True)
class Compression:
    """One compressor's part of a decode step: `compress_decodes`' per-compressor arguments (kv,
    score [D, c·d] of the decoding rows; pending rings; `dest` its entries or indexer keys)."""

    kv: torch.Tensor
    score: torch.Tensor
    ring_kv: torch.Tensor
    ring_score: torch.Tensor
    dest: torch.Tensor
    ratio: int
    overlap: bool
    norm_weight: torch.Tensor
    eps: float
    ape: torch.Tensor
    record: Record | None = None


def write_decode_step(ring: torch.Tensor, kv: torch.Tensor, batch: RaggedBatch, record: Record | None,
                      compressions: Sequence[Compression], inv_freq: torch.Tensor, pooling: Pooling = pool) -> None:
    """ring [S, W, d] ← kv [D, d] (FP8 records under `record`); then each of `compressions` (at
    most two: a layer's main compressor and its indexer's) for the batch's decodes (`pooling` as
    for `compress_decodes`)."""
    assert batch.only_decodes, "a step with prefill chunks writes its window after attention"
    write_window(ring, kv, batch, record)
    dec = batch.decodes
    for c in compressions:
        compress_decodes(c.kv, c.score, c.ring_kv, c.ring_score, dec.slots, dec.positions, dec.frozen_until,
                         dec.tables, c.dest, c.ratio, c.overlap, c.norm_weight, c.eps, inv_freq, c.ape, c.record,
                         pooling)
