"""A sequence's DeepSeek-V4.1 KV between the State and Block Cache and the dense view the model
computes on (`SequenceKV`): `gather` reads what a step needs, `scatter` writes back what it made.

Where each part lives (cache/layout.py, kind `csa2` for the KV sources):
- every layer's window: the slot's ring, token p at row p mod W; the last W − 1 before the step are
  read (none below the chunk's `window_from`: a prefix hit recomputes them);
- a source's entries and indexer keys: the blocks of the sequence's table, entry e in block
  e // (B / m) at row e mod (B / m); every entry whole before the step is read, and those a prefix hit
  holds past it (below `frozen_until`), which are read and never written;
- a ratio-2 source's open group: the slot's pending ring, token p at row p mod m.

This is the plain-torch path, one sequence at a time; batched device kernels read the same storage.
"""

from __future__ import annotations

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.engine.model.metadata import SeqChunk
from v4serve.engine.model.v41.attention import SequenceKV, SourceKV
from v4serve.engine.model.v41.config import V41Config


def _entry_places(seq: SeqChunk, ids: torch.Tensor, per_block: int) -> tuple[torch.Tensor, torch.Tensor]:
    table = torch.tensor(seq.block_table, dtype=torch.long, device=ids.device)
    return table[ids // per_block], ids % per_block


def gather(cfg: V41Config, kv: DeviceKV, seq: SeqChunk) -> SequenceKV:
    dev, w = kv.device, cfg.window
    positions = torch.arange(max(seq.window_from, seq.start - (w - 1), 0), seq.start, device=dev)
    window = [kv.layers[layer].window[seq.slot, positions % w] for layer in range(cfg.num_layers)]
    sources = {}
    for layer in cfg.kv_source_layers:
        part, ratio = kv.layers[layer], cfg.ratio(layer)
        assert part.entries is not None and part.index_keys is not None
        ids = torch.arange(max(seq.start, seq.frozen_until) // ratio, device=dev)
        blocks, rows = _entry_places(seq, ids, part.layout.entries_per_block)
        open_group = torch.arange(seq.start // ratio * ratio, seq.start, device=dev)
        if part.pending_kv is not None and part.pending_score is not None:
            pending_kv = part.pending_kv[seq.slot, open_group % ratio].float()
            pending_score = part.pending_score[seq.slot, open_group % ratio].float()
        else:  # one entry per token: no group stays open
            pending_kv = pending_score = torch.empty(0, cfg.head_dim, device=dev)
        sources[layer] = SourceKV(part.entries[blocks, rows], part.index_keys[blocks, rows], pending_kv,
                                  pending_score)
    return SequenceKV(seq.start, window, sources)


def scatter(cfg: V41Config, kv: DeviceKV, seq: SeqChunk, view: SequenceKV) -> None:
    """Write back what the step added to `view` (gathered for `seq`, then advanced by its tokens)."""
    dev, w, end = kv.device, cfg.window, seq.end
    assert view.length == end
    for layer in range(cfg.num_layers):
        rows = view.window[layer]
        new = min(seq.num_new, rows.shape[0])  # the view keeps the last W − 1
        positions = torch.arange(end - new, end, device=dev)
        kv.layers[layer].window[seq.slot, positions % w] = rows[rows.shape[0] - new:]
    for layer in cfg.kv_source_layers:
        part, ratio, source = kv.layers[layer], cfg.ratio(layer), view.sources[layer]
        assert part.entries is not None and part.index_keys is not None
        ids = torch.arange(max(seq.start, seq.frozen_until) // ratio, source.entries.shape[0], device=dev)
        blocks, rows = _entry_places(seq, ids, part.layout.entries_per_block)
        part.entries[blocks, rows] = source.entries[ids]
        part.index_keys[blocks, rows] = source.index_keys[ids]
        if part.pending_kv is not None and part.pending_score is not None:
            open_group = torch.arange(end // ratio * ratio, end, device=dev)
            assert source.pending_kv.shape[0] == open_group.shape[0]
            part.pending_kv[seq.slot, open_group % ratio] = source.pending_kv.to(part.pending_kv.dtype)
            part.pending_score[seq.slot, open_group % ratio] = source.pending_score.to(part.pending_score.dtype)
