"""Slot states at block boundaries inside a prefill chunk, without ending the chunk there.

A snapshot is a slot's state (every layer's window ring and compressor rings) at a sealed block
boundary. Ending each prefill chunk on such a boundary so the state exists there costs a forward
pass per block: `full` snapshots every block, so a 2,048-token chunk would run as 16 passes of 128.
Instead the chunk runs whole while the model hands over the rows it writes into the rings
(`StateCapture.keep`, before the layer writes them): each boundary's state is the layer's slot as
it was before the chunk, with the rows of positions up to the boundary written as the kernels write
them. A ring keeps the last R positions written, so that is exactly the state a chunk ending at the
boundary would have left; after the step `states_at` copies the states to the host.

Torch only; the model calls `keep`, the engine `states_at`, the KV manager saves what comes out.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from v4serve.cache.device_kv import DeviceKV, LayerKV, slot_bytes
from v4serve.kernels.attention import upload
from v4serve.kernels.compressor import biased
from v4serve.kernels.decode_writes import Compression
from v4serve.kernels.kv_fp8 import stored


@dataclass
class CaptureSeq:
    """One sequence of the step whose chunk crosses snapshot points."""

    owner: str  # whose chunk it is (the engine's request id)
    slot: int  # its State Cache slot
    offset: int  # its first row in the flattened batch
    start: int  # the position of that row
    points: tuple[int, ...]  # boundaries strictly inside the chunk, ascending
    # id(LayerKV) → the layer's slot tensors at every point, [points, ...] each, in `LayerKV.slot_tensors` order.
    states: dict[int, list[torch.Tensor]] = field(default_factory=dict)
    _writes: dict[int, tuple[torch.Tensor, ...]] = field(default_factory=dict)

    def writes(self, ring_rows: int, device: torch.device) -> tuple[torch.Tensor, ...]:
        """(point, ring row, chunk row) of every row a ring of `ring_rows` rows takes from the chunk
        at each point: positions [max(start, p − ring_rows), p) of point p, each once. Built once
        per ring length (a few per model), uploaded without blocking."""
        if ring_rows not in self._writes:
            columns: tuple[list[int], list[int], list[int]] = ([], [], [])
            for i, point in enumerate(self.points):
                for position in range(max(self.start, point - ring_rows), point):
                    columns[0].append(i)
                    columns[1].append(position % ring_rows)
                    columns[2].append(position - self.start)
            self._writes[ring_rows] = tuple(upload(c, device) for c in columns)
        return self._writes[ring_rows]


class StateCapture:
    """The slot states at the snapshot points inside the chunks of the sequences in `seqs`."""

    def __init__(self, seqs: Sequence[CaptureSeq]) -> None:
        self.seqs = list(seqs)

    def keep(self, layer: LayerKV, window_rows: torch.Tensor, compressions: Sequence[Compression]) -> None:
        """A layer's ring rows of the whole batch, handed over before the layer writes them: window
        keys [T, d] (as the window kernel takes them) and each compressor's kv and score rows
        [T, c·d] (scores before the position bias). The layer's slot still holds its state from
        before the chunk; each point's state is that plus the rows up to the point (only the last
        R of them stay in a ring of R rows): one copy and one scatter per ring for all points."""
        rings = layer.slot_tensors()
        records = [layer.layout.record, *[None] * (len(rings) - 1)]  # only window keys may be FP8 records
        for seq in self.seqs:
            end = seq.offset + seq.points[-1] - seq.start
            rows = [window_rows[seq.offset:end]]
            for c in compressions:
                rows += [c.kv[seq.offset:end], biased(c.score[seq.offset:end], c.ape, seq.start, c.ratio)]
            assert len(rows) == len(rings), "a layer's ring rows do not match its slot"
            parts = []
            for ring, new, record in zip(rings, rows, records, strict=True):
                state = ring[seq.slot].unsqueeze(0).repeat(len(seq.points), *[1] * (ring.dim() - 1))
                point, ring_row, chunk_row = seq.writes(ring.shape[1], ring.device)
                state[point, ring_row] = stored(new[chunk_row], ring, record)
                parts.append(state)
            seq.states[id(layer)] = parts

    def states_at(self, kv: DeviceKV, seq: CaptureSeq) -> list[tuple[int, torch.Tensor]]:
        """(boundary, host copy of the slot state there, as `DeviceKV.read_slot` makes it) for each of
        `seq`'s points (KeyError if a layer of `kv` handed nothing over)."""
        host = [part.to("cpu") for layer in kv.layers for part in seq.states[id(layer)]]
        return [(point, slot_bytes([part[i] for part in host])) for i, point in enumerate(seq.points)]
