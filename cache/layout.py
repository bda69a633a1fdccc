"""Shapes of every KV tensor, derived once from the model config. Plain Python, no torch.

A State Cache slot holds, per layer, the window ring (`window` rows, token p at row p mod window)
and, for compressed layers, the compressor's pending rows as a ring too: CSA keeps two windows
(2m rows, the previous window's rows feed the overlapping entry), HCA keeps one (m rows).
A Block Cache block holds `block_size` tokens' worth of compressed entries for every compressed
layer at the same block id: `block_size / m` entries (and, for CSA, as many indexer keys).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol


class ModelShape(Protocol):
    num_layers: int
    head_dim: int
    index_head_dim: int
    window: int
    compress_ratios: tuple[int, ...]

    def layer_kind(self, layer: int) -> str: ...

    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True)
class LayerLayout:
    kind: str  # "swa", "csa" or "hca"
    ratio: int  # 0 for swa
    head_dim: int
    index_head_dim: int
    window: int
    block_size: int

    @property
    def overlap(self) -> bool:
        return self.kind == "csa"

    @property
    def pending_rows(self) -> int:
        """Compressor ring length: two windows when entries overlap, one otherwise."""
        if not self.ratio:
            return 0
        return 2 * self.ratio if self.overlap else self.ratio

    @property
    def pending_width(self) -> int:
        return (2 if self.overlap else 1) * self.head_dim

    @property
    def entries_per_block(self) -> int:
        return self.block_size // self.ratio if self.ratio else 0

    def slot_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each State Cache tensor of one slot, in storage order (the one definition that
        the device tensors are allocated from)."""
        shapes = {"window": (self.window, self.head_dim)}
        if self.ratio:
            shapes["pending_kv"] = shapes["pending_score"] = (self.pending_rows, self.pending_width)
        if self.overlap:  # the indexer's own compressor: overlapping, 2·dI wide
            shapes["index_pending_kv"] = shapes["index_pending_score"] = (2 * self.ratio, 2 * self.index_head_dim)
        return shapes

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each Block Cache tensor of one block, in storage order."""
        shapes: dict[str, tuple[int, ...]] = {}
        if self.ratio:
            shapes["entries"] = (self.entries_per_block, self.head_dim)
        if self.overlap:
            shapes["index_keys"] = (self.entries_per_block, self.index_head_dim)
        return shapes

    def state_elements(self) -> int:
        """Elements per State Cache slot for this layer (fixed, whatever the context length)."""
        return sum(math.prod(shape) for shape in self.slot_shapes().values())

    def block_elements(self) -> int:
        """Elements per Block Cache block for this layer."""
        return sum(math.prod(shape) for shape in self.block_shapes().values())


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerLayout, ...]
    block_size: int
    window: int

    @classmethod
    def from_config(cls, cfg: ModelShape) -> KVLayout:
        block = cfg.block_size
        layers = tuple(
            LayerLayout(
                kind=cfg.layer_kind(i),
                ratio=cfg.compress_ratios[i],
                head_dim=cfg.head_dim,
                index_head_dim=cfg.index_head_dim,
                window=cfg.window,
                block_size=block,
            )
            for i in range(cfg.num_layers)
        )
        return cls(layers=layers, block_size=block, window=cfg.window)

    def state_bytes_per_slot(self, itemsize: int) -> int:
        return sum(layer.state_elements() for layer in self.layers) * itemsize

    def block_bytes(self, itemsize: int) -> int:
        return sum(layer.block_elements() for layer in self.layers) * itemsize

    def paged_bytes_per_token(self, itemsize: int) -> int:
        """What a uniform paged layout would keep: one uncompressed KV entry per token per layer."""
        return sum(layer.head_dim for layer in self.layers) * itemsize

    def table(self, itemsize: int) -> list[tuple[str, int, float, int]]:
        """Rows of (layer kind, layer count, Block Cache bytes per token, State Cache bytes per slot)."""
        rows = []
        for kind in ("swa", "csa", "hca"):
            group = [layer for layer in self.layers if layer.kind == kind]
            if not group:
                continue
            per_token = sum(layer.block_elements() for layer in group) * itemsize / self.block_size
            state = sum(layer.state_elements() for layer in group) * itemsize
            rows.append((kind, len(group), per_token, state))
        return rows


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def cache_table(layout: KVLayout, itemsize: int, num_slots: int, num_blocks: int) -> str:
    """The startup table: bytes per token per layer kind, per slot, and the totals."""
    lines = [f"KV cache: {layout.block_size}-token blocks, window {layout.window}, {itemsize}-byte elements",
             f"{'layer kind':<11}{'layers':>7}{'Block Cache B/token':>21}{'State Cache per slot':>22}"]
    for kind, count, per_token, state in layout.table(itemsize):
        lines.append(f"{kind:<11}{count:>7}{per_token:>21.1f}{_human(state):>22}")
    per_token = layout.block_bytes(itemsize) / layout.block_size
    slot = layout.state_bytes_per_slot(itemsize)
    lines.append(f"{'total':<11}{len(layout.layers):>7}{per_token:>21.1f}{_human(slot):>22}")
    paged = layout.paged_bytes_per_token(itemsize)
    lines.append(f"State Cache: {num_slots} slots = {_human(num_slots * slot)}; Block Cache: {num_blocks} blocks "
                 f"({num_blocks * layout.block_size} tokens) = {_human(num_blocks * layout.block_bytes(itemsize))}; "
                 f"a uniform paged layout would need {paged} B/token ({paged / per_token:.1f}x)")
    return "\n".join(lines)
