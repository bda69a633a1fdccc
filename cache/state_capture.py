"""Slot states at block boundaries inside a prefill chunk, without ending the chunk there.

A snapshot is a slot's state (every layer's window ring and compressor rings) at a sealed block
boundary. Ending each prefill chunk on such a boundary so the state exists there costs a forward
pass per block: `full` snapshots every block, so a 2,048-token chunk would run as 16 passes of 128.
Instead the chunk runs whole while the model hands over the rows it writes into the rings
(`StateCapture.keep`), and after the step each boundary's state is assembled (`states_at`): the
slot as it was before the chunk, with the rows of positions up to the boundary written as the
kernels write them. A ring keeps the last R positions written, so that is exactly the state a
chunk ending at the boundary would have left.

Torch only; the model calls `keep`, the engine `states_at`, the KV manager saves what comes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from v4serve.cache.device_kv import DeviceKV, LayerKV
from v4serve.kernels.compressor import biased
from v4serve.kernels.decode_writes import Compression
from v4serve.kernels.paged import ring_write


@dataclass
class CaptureSeq:
    """One sequence of the step whose chunk crosses snapshot points."""

    owner: str  # whose chunk it is (the engine's request id)
    offset: int  # its first row in the flattened batch
    start: int  # the position of that row
    points: tuple[int, ...]  # boundaries strictly inside the chunk, ascending
    base: list[torch.Tensor]  # its slot's state before the chunk (`DeviceKV.copy_slot`)
    # id(LayerKV) → rows of positions [start, points[-1]) for each of the layer's slot tensors, in
    # `LayerKV.slot_tensors` order, as they enter the rings (window keys; compressor kv and biased scores).
    rows: dict[int, list[torch.Tensor]] = field(default_factory=dict)


class StateCapture:
    """The rows one step writes into the rings of the sequences in `seqs`."""

    def __init__(self, seqs: Sequence[CaptureSeq]) -> None:
        self.seqs = list(seqs)

    def keep(self, layer: LayerKV, window_rows: torch.Tensor, compressions: Sequence[Compression]) -> None:
        """A layer's ring rows of the whole batch: window keys [T, d] (as the window kernel takes
        them) and each compressor's kv and score rows [T, c·d] (scores before the position bias)."""
        for seq in self.seqs:
            rows = slice(seq.offset, seq.offset + seq.points[-1] - seq.start)
            parts = [window_rows[rows].clone()]
            for c in compressions:
                parts += [c.kv[rows].clone(), biased(c.score[rows], c.ape, seq.start, c.ratio)]
            seq.rows[id(layer)] = parts

    def states_at(self, kv: DeviceKV, seq: CaptureSeq) -> list[tuple[int, list[torch.Tensor]]]:
        """(boundary, host copy of the slot state there) for each of `seq`'s points."""
        state = [t.clone() for t in seq.base]
        out, done = [], seq.start
        for point in seq.points:
            at = 0
            for layer in kv.layers:
                rows = seq.rows[id(layer)]
                assert len(rows) == len(layer.slot_tensors()), "a layer's captured rows do not match its slot"
                records = [layer.layout.record, *[None] * (len(rows) - 1)]  # only window keys may be FP8 records
                for part, new, record in zip(state[at:at + len(rows)], rows, records, strict=True):
                    ring_write(part, point, new[done - seq.start:point - seq.start], record)
                at += len(rows)
            out.append((point, [t.to("cpu", copy=True) for t in state]))
            done = point
        return out
