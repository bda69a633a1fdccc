"""Torch storage behind the KV bookkeeping: preallocated once, indexed by slot and block id."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cache.layout import KVLayout, LayerLayout


@dataclass
class LayerKV:
    """One layer's tensors. Per-slot (State Cache) tensors lead with the slot axis, Block Cache
    tensors with the block axis. Absent parts are None (a window-only layer has no compressor)."""

    layout: LayerLayout
    window: torch.Tensor  # [S, window, d]
    pending_kv: torch.Tensor | None = None  # [S, rows, c·d]
    pending_score: torch.Tensor | None = None  # [S, rows, c·d]
    index_pending_kv: torch.Tensor | None = None  # [S, 2m, 2·dI]
    index_pending_score: torch.Tensor | None = None  # [S, 2m, 2·dI]
    entries: torch.Tensor | None = None  # [NB, B/m, d]
    index_keys: torch.Tensor | None = None  # [NB, B/m, dI]

    def slot_tensors(self) -> list[torch.Tensor]:
        parts = (self.window, self.pending_kv, self.pending_score, self.index_pending_kv,
                 self.index_pending_score)
        return [t for t in parts if t is not None]

    def block_tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.entries, self.index_keys) if t is not None]


class KVStorage:
    """All KV tensors of all layers: `num_slots` State Cache slots and `num_blocks` blocks."""

    def __init__(self, layout: KVLayout, num_slots: int, num_blocks: int,
                 dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.num_slots = num_slots
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.layers = [self._alloc(layer) for layer in layout.layers]

    def _alloc(self, layer: LayerLayout) -> LayerKV:
        def zeros(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=self.dtype, device=self.device)

        s, d = self.num_slots, layer.head_dim
        kv = LayerKV(layout=layer, window=zeros(s, layer.window, d))
        if layer.ratio:
            rows, width = layer.pending_rows, layer.pending_width
            kv.pending_kv, kv.pending_score = zeros(s, rows, width), zeros(s, rows, width)
            kv.entries = zeros(self.num_blocks, layer.entries_per_block, d)
        if layer.overlap:
            di = layer.index_head_dim
            kv.index_pending_kv = zeros(s, 2 * layer.ratio, 2 * di)
            kv.index_pending_score = zeros(s, 2 * layer.ratio, 2 * di)
            kv.index_keys = zeros(self.num_blocks, layer.entries_per_block, di)
        return kv

    def state_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.slot_tensors())

    def block_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for layer in self.layers for t in layer.block_tensors())

    def read_slot(self, slot: int) -> list[torch.Tensor]:
        """A host copy of one slot's whole state (a snapshot), in a fixed order."""
        return [t[slot].to("cpu", copy=True) for layer in self.layers for t in layer.slot_tensors()]

    def slot_nbytes(self) -> int:
        return self.state_bytes() // self.num_slots

    def clear_slot(self, slot: int) -> None:
        """Zero a slot so nothing of its previous owner can leak into a new request."""
        for layer in self.layers:
            for t in layer.slot_tensors():
                t[slot].zero_()

    def write_slot(self, slot: int, state: list[torch.Tensor]) -> None:
        parts = [t for layer in self.layers for t in layer.slot_tensors()]
        if len(parts) != len(state):
            raise ValueError(f"snapshot has {len(state)} tensors, layout needs {len(parts)}")
        for dst, src in zip(parts, state, strict=True):
            dst[slot].copy_(src, non_blocking=True)
