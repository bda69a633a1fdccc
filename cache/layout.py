"""Shapes of every KV tensor, derived once from the model config. Plain Python, no torch.

A State Cache slot holds, per layer, the window ring (`window` rows, token p at row p mod window)
and, for compressed layers, the compressor's pending rows as a ring too: CSA keeps two windows
(2m rows, the previous window's rows feed the overlapping entry), HCA keeps one (m rows).
A Block Cache block holds `block_size` tokens' worth of compressed entries for every compressed
layer at the same block id: `block_size / m` entries (and, for CSA, as many indexer keys).

DeepSeek-V4.1 (`csa2`): only its KV source layers own compressed KV (entries and indexer keys per
block; the open pooling group, m rows, in the slot when m > 1); every other layer, reuse and re-index
ones included, owns a window alone.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Protocol

FP8_GROUP = 64  # channels per e8m0 scale, as the official model quantizes its KV
KV_CACHE_DTYPES = ("auto", "fp8")


def check_kv_cache_dtype(value: str) -> None:
    if value not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {value!r}")


COMPUTE_ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4}  # bytes of a value in each compute dtype


def key_record(head_dim: int, rope_dim: int, compute_dtype: str, kv_cache_dtype: str) -> KVRecord | None:
    """How a key is stored under `--kv-cache-dtype`: `fp8` gives its FP8 record (rope channels in the
    model's compute dtype, a torch dtype name); `auto` gives None (keys in the compute dtype)."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype != "fp8":
        return None
    return KVRecord(head_dim=head_dim, rope_dim=rope_dim, rope_dtype=compute_dtype,
                    rope_itemsize=COMPUTE_ITEMSIZE[compute_dtype])


class ModelShape(Protocol):
    num_layers: int
    head_dim: int
    index_head_dim: int
    window: int
    compress_ratios: tuple[int, ...]
    hidden_size: int
    hc_mult: int

    def layer_kind(self, layer: int) -> str: ...

    @property
    def block_size(self) -> int: ...


@dataclass(frozen=True)
class KVRecord:
    """Bytes of one key stored in FP8 (`--kv-cache-dtype fp8`), as DeepSeek-V4 keeps its KV: the
    non-rope channels as e4m3 codes with one power-of-two (e8m0) scale per 64 channels, the rope
    channels unquantized (positions need the precision) in the compute dtype.

    Layout: [codes: nope bytes][scales: one byte per group][padding][rope: rope_dim values]."""

    head_dim: int
    rope_dim: int
    rope_dtype: str  # torch dtype name of the rope part: the model's compute dtype
    rope_itemsize: int

    @property
    def nope(self) -> int:
        return self.head_dim - self.rope_dim

    @property
    def groups(self) -> int:
        return -(-self.nope // FP8_GROUP)

    @property
    def rope_offset(self) -> int:
        """Aligned so the rope part can be viewed in its own dtype."""
        return -(-(self.nope + self.groups) // self.rope_itemsize) * self.rope_itemsize

    @property
    def nbytes(self) -> int:
        return self.rope_offset + self.rope_dim * self.rope_itemsize


@dataclass(frozen=True)
class LayerLayout:
    kind: str  # "swa", "csa" or "hca"; V4.1's KV sources "csa2"
    ratio: int  # 0 for swa
    head_dim: int
    index_head_dim: int
    window: int
    block_size: int
    record: KVRecord | None = None  # FP8 window rows and entries; None: one compute-dtype value per channel
    # A multi-token-prediction layer's extra slot rows: the main model's last hidden state [hc, D] at the
    # position before the layer's next one (its input there), kept with the window so that a slot copy,
    # snapshot or store file carries everything the layer needs to go on.
    hidden: tuple[int, int] | None = None

    @property
    def overlap(self) -> bool:
        return self.kind == "csa"

    @property
    def has_index_keys(self) -> bool:
        return self.kind in ("csa", "csa2")

    @property
    def pending_rows(self) -> int:
        """Compressor ring length: two windows when entries overlap, one otherwise (none for a
        one-token entry: a projection)."""
        if not self.ratio or (self.kind == "csa2" and self.ratio == 1):
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
        shapes = {"window": (self.window, self.key_width)}
        if self.pending_rows:
            shapes["pending_kv"] = shapes["pending_score"] = (self.pending_rows, self.pending_width)
        if self.overlap:  # the indexer's own compressor: overlapping, 2·dI wide
            shapes["index_pending_kv"] = shapes["index_pending_score"] = (2 * self.ratio, 2 * self.index_head_dim)
        if self.hidden is not None:
            shapes["hidden"] = self.hidden
        return shapes

    def block_shapes(self) -> dict[str, tuple[int, ...]]:
        """Shape of each Block Cache tensor of one block, in storage order."""
        shapes: dict[str, tuple[int, ...]] = {}
        if self.ratio:
            shapes["entries"] = (self.entries_per_block, self.key_width)
        if self.has_index_keys:
            shapes["index_keys"] = (self.entries_per_block, self.index_head_dim)
        return shapes

    @property
    def key_width(self) -> int:
        """Last dim of the window and entry tensors: channels, or bytes of an FP8 record."""
        return self.record.nbytes if self.record else self.head_dim

    def packed(self, name: str) -> bool:
        """Whether a tensor holds FP8 records (bytes) rather than compute-dtype values."""
        return self.record is not None and name in ("window", "entries")

    def state_bytes(self, itemsize: int) -> int:
        """Bytes per State Cache slot for this layer (fixed, whatever the context length)."""
        return self._bytes(self.slot_shapes(), itemsize)

    def block_bytes(self, itemsize: int) -> int:
        """Bytes per Block Cache block for this layer."""
        return self._bytes(self.block_shapes(), itemsize)

    def _bytes(self, shapes: dict[str, tuple[int, ...]], itemsize: int) -> int:
        return sum(math.prod(shape) * (1 if self.packed(name) else itemsize) for name, shape in shapes.items())


@dataclass(frozen=True)
class KVLayout:
    layers: tuple[LayerLayout, ...]
    block_size: int
    window: int

    # Multi-token-prediction layers after the main ones (window-only, each with its hidden rows).
    mtp_layers: int = 0

    @classmethod
    def from_config(cls, cfg: ModelShape, record: KVRecord | None = None, mtp_layers: int = 0) -> KVLayout:
        block = cfg.block_size

        def layer(i: int, hidden: tuple[int, int] | None = None) -> LayerLayout:
            kind = cfg.layer_kind(i)
            # A V4.1 layer that reads another's entries owns none: window only, whatever its ratio.
            return LayerLayout(kind=kind, ratio=cfg.compress_ratios[i] if i < cfg.num_layers and kind != "swa" else 0,
                               head_dim=cfg.head_dim, index_head_dim=cfg.index_head_dim, window=cfg.window,
                               block_size=block, record=record, hidden=hidden)

        mtp = (cfg.hc_mult, cfg.hidden_size)
        layers = (*(layer(i) for i in range(cfg.num_layers)),
                  *(layer(cfg.num_layers + k, mtp) for k in range(mtp_layers)))
        return cls(layers=layers, block_size=block, window=cfg.window, mtp_layers=mtp_layers)

    def with_record(self, record: KVRecord | None) -> KVLayout:
        """The same model with keys stored another way (for the startup table's comparison)."""
        return dataclasses.replace(self, layers=tuple(dataclasses.replace(layer, record=record)
                                                      for layer in self.layers))

    def state_bytes_per_slot(self, itemsize: int) -> int:
        return sum(layer.state_bytes(itemsize) for layer in self.layers)

    def block_bytes(self, itemsize: int) -> int:
        return sum(layer.block_bytes(itemsize) for layer in self.layers)

    def paged_bytes_per_token(self, itemsize: int) -> int:
        """What a uniform paged layout would keep: one uncompressed KV entry per token per layer."""
        return sum(layer.head_dim for layer in self.layers) * itemsize

    def table(self, itemsize: int) -> list[tuple[str, int, float, int]]:
        """Rows of (layer kind, layer count, Block Cache bytes per token, State Cache bytes per slot)."""
        rows = []
        for kind in ("swa", "csa", "hca", "csa2", "mtp"):  # a multi-token-prediction layer has its own row
            group = [layer for layer in self.layers if ("mtp" if layer.hidden is not None else layer.kind) == kind]
            if not group:
                continue
            per_token = sum(layer.block_bytes(itemsize) for layer in group) / self.block_size
            state = sum(layer.state_bytes(itemsize) for layer in group)
            rows.append((kind, len(group), per_token, state))
        return rows


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n:.0f} B"
        n /= 1024
    return f"{n:.1f} GiB"


def cache_table(layout: KVLayout, itemsize: int, num_slots: int, num_blocks: int,
                record: KVRecord | None = None) -> str:
    """The startup table: bytes per token per layer kind, per slot, and the totals; `record` is the
    FP8 key layout, shown either way so the two choices of --kv-cache-dtype can be compared."""
    keys = layout.layers[0].record if layout.layers else None
    stored = f"FP8 keys ({keys.nbytes}-byte records)" if keys else f"{itemsize}-byte elements"
    lines = [f"KV cache: {layout.block_size}-token blocks, window {layout.window}, {stored}",
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
    if record is not None:
        other = layout.with_record(None if keys else record)
        fp8, full = (layout, other) if keys else (other, layout)
        lines.append(f"Keys: FP8 (--kv-cache-dtype fp8) {_per_token(fp8, itemsize):.1f} B/token and "
                     f"{_human(fp8.state_bytes_per_slot(itemsize))}/slot; {itemsize}-byte (auto) "
                     f"{_per_token(full, itemsize):.1f} B/token and {_human(full.state_bytes_per_slot(itemsize))}/slot")
    return "\n".join(lines)


def _per_token(layout: KVLayout, itemsize: int) -> float:
    return layout.block_bytes(itemsize) / layout.block_size
