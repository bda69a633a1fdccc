"""The compressors' pooling (plain torch): every m tokens become one entry — a softmax over the m
token slots per channel (CSA overlaps: entry i also pools window i−1 through the first half of a
2d-wide projection), then RMSNorm and RoPE at position i·m.

`compress_decodes` and `compress_chunk` are the twins of `compressor_triton`'s (same signatures): a
compressor's whole update for the decoding sequences of a step (store each new row in its pending
ring and, where it completes an entry, pool that entry and write it to the Block Cache), and for
one sequence's prefill chunk (pool and write every entry the chunk completes, then keep the chunk's
last rows pending).

Shapes: D = decoding sequences, m = ratio, c·d = projection width (c = 2 with overlap), R = pending
ring rows (2m with overlap, else m), r = rotary dims.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from v4serve.kernels.kv_fp8 import Record
from v4serve.kernels.norm_rope import rms_norm, rope
from v4serve.kernels.paged import ring_read, ring_read_batched, ring_write, ring_write_batched, write_entries_batched


def pool(win_kv: torch.Tensor, win_score: torch.Tensor, index: torch.Tensor, ratio: int, overlap: bool,
         norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor) -> torch.Tensor:
    """win_* [B, w, m, c·d]: consecutive windows, starting one window before the first entry when
    entries overlap → entries [B, E, d] at entry indices `index` [E] or [B, E]."""
    d = norm_weight.shape[0]
    if overlap:
        # Entry i pools window i−1 through channels [:d] and window i through [d:].
        kv = torch.cat([win_kv[:, :-1, :, :d], win_kv[:, 1:, :, d:]], dim=2)
        score = torch.cat([win_score[:, :-1, :, :d], win_score[:, 1:, :, d:]], dim=2)
    else:
        kv, score = win_kv, win_score
    pooled = rms_norm((kv * score.softmax(dim=2)).sum(dim=2), norm_weight, eps)  # [B, E, d]
    angles = (index * ratio).reshape(-1).float()[:, None] * inv_freq.to(index.device)[None, :]
    return rope(pooled.reshape(-1, d), angles.cos(), angles.sin()).view(pooled.shape)


Pooling = Callable[..., torch.Tensor]  # `pool`'s signature


def compress_decodes(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                     slots: torch.Tensor, positions: torch.Tensor, frozen_until: torch.Tensor, tables: torch.Tensor,
                     dest: torch.Tensor, ratio: int, overlap: bool, norm_weight: torch.Tensor, eps: float,
                     inv_freq: torch.Tensor, ape: torch.Tensor, record: Record | None = None,
                     pooling: Pooling = pool) -> None:
    """kv, score [D, c·d] (the new rows, at `positions` [D]; score without the slot's position bias
    `ape` [m, c·d], added here); rings [S, R, c·d]; tables [D, nb] the
    sequences' block tables; dest [NB, P, d] entries (FP8 records under `record`) or indexer keys.
    Entries below a sequence's `frozen_until` [D] are already cached and not written again.
    `pooling`: `pool`, or `invariant.pool_entries` under --batch-invariant."""
    m = ratio
    score = score.float() + ape[positions % m].float()
    ring_write_batched(ring_kv, slots, positions, kv)
    ring_write_batched(ring_score, slots, positions, score)
    entry = (positions + 1) // m - 1
    which = ((((positions + 1) % m) == 0) & (entry >= frozen_until // m)).nonzero().flatten()
    if not len(which):
        return
    entry, slot = entry[which], slots[which]
    span = 2 * m if overlap else m
    pos = (entry + 1)[:, None] * m - span + torch.arange(span, device=kv.device)[None, :]  # [Dc, span]
    empty = (pos < 0)[..., None]
    win_kv = ring_read_batched(ring_kv, slot, pos).float().masked_fill(empty, 0.0)
    win_score = ring_read_batched(ring_score, slot, pos).float().masked_fill(empty, float("-inf"))
    n = len(which)
    entries = pooling(win_kv.view(n, span // m, m, -1), win_score.view(n, span // m, m, -1), entry[:, None], m,
                      overlap, norm_weight, eps, inv_freq)[:, 0]
    write_entries_batched(dest, tables[which], entry, entries, record)


def compress_chunk(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                   start: int, frozen_until: int, table: torch.Tensor, dest: torch.Tensor, ratio: int,
                   overlap: bool, norm_weight: torch.Tensor, eps: float, inv_freq: torch.Tensor, ape: torch.Tensor,
                   record: Record | None = None, pooling: Pooling = pool) -> None:
    """kv, score [n, c·d]: one sequence's rows at positions [start, start + n) (score without the
    slot's position bias `ape`, added here); ring_* [R, c·d] its pending rings; table [nb] its block
    table; dest as for `compress_decodes`. Pools every entry the chunk completes (rows before
    `start` come from the rings, positions below 0 are empty slots), except those below
    `frozen_until` (already cached), writes them, then keeps the chunk's last rows pending."""
    m, end = ratio, start + kv.shape[0]
    score = biased(score, ape, start, m)
    first, stop = max(start // m, frozen_until // m), end // m
    if first < stop:
        lo = (first - 1) * m if overlap else first * m
        rows_kv, rows_score = _window_rows(kv, score, ring_kv, ring_score, start, lo, stop * m)
        windows = rows_kv.shape[0] // m
        index = torch.arange(first, stop, device=kv.device)
        entries = pooling(rows_kv.view(1, windows, m, -1), rows_score.view(1, windows, m, -1), index, m, overlap,
                          norm_weight, eps, inv_freq)[0]
        write_entries_batched(dest, table[None].expand(len(index), -1), index, entries, record)
    ring_write(ring_kv, end, kv)
    ring_write(ring_score, end, score)


def biased(score: torch.Tensor, ape: torch.Tensor, start: int, ratio: int) -> torch.Tensor:
    """Score rows [n, c·d] of positions [start, start + n) plus their slot's position bias (fp32)."""
    positions = torch.arange(start, start + score.shape[0], device=score.device)
    return score.float() + ape[positions % ratio].float()


def _window_rows(kv: torch.Tensor, score: torch.Tensor, ring_kv: torch.Tensor, ring_score: torch.Tensor,
                 start: int, lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of positions [lo, hi) (fp32): empty slots below 0 (zero kv, −inf score), ring rows
    below `start`, the chunk's rows from `start` on."""
    parts_kv, parts_score = [], []
    if lo < 0:
        parts_kv.append(kv.new_zeros(-lo, kv.shape[1], dtype=torch.float32))
        parts_score.append(score.new_full((-lo, score.shape[1]), float("-inf")))
    if max(lo, 0) < start:
        held = torch.arange(max(lo, 0), start, device=kv.device)
        parts_kv.append(ring_read(ring_kv, held).float())
        parts_score.append(ring_read(ring_score, held).float())
    skip = max(lo - start, 0)
    parts_kv.append(kv[skip:hi - start].float())
    parts_score.append(score[skip:hi - start])
    return torch.cat(parts_kv), torch.cat(parts_score)
