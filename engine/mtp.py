"""Drafts from DeepSeek-V4's multi-token-prediction (MTP) layer.

The layer at position p reads the main model's last state there (h_p, its streams before the head) and
the embedding of token p+1, and guesses token p+2 through the shared head (engine/model/v4/model.py
`MTPBlock`). Its output state stands in for the main model's at p+1, so the same layer guesses k
tokens ahead by running on its own guesses.

Its cache is the last KV layer of the request's State Cache slot: the layer's window rows and `hidden`,
the main state it has not consumed yet. So a slot copy before a drafted pass, a snapshot, a restore
after a prefix hit and an SSD-store file carry it with the main layers' rows, and a rejected draft
undoes it with them. The invariant: once the main model has computed positions < N, the layer has
consumed positions < N-1 and `hidden` holds h_{N-1} (`commit`, after every pass whose tokens are
kept, before the scheduler seals anything). Drafting (`propose`) runs the layer at N-1 on the token
sampled there, then on its own guesses at N, N+1, ...; the rows those write are put back afterwards
(the row at N-1 is written again by the next commit, from the same inputs).

Under tensor parallelism every rank runs the layer alike (its heads and experts split as the main
layers'): what it runs is described by numbers alone (`MTPRows`, `MTPSeed`), which rank 0 sends the
other ranks (engine/step_plan.py) and every rank hands to its own `MTPLayer`.

Drafts are the layer's greedy guesses: a proposal that puts all its mass on one token, which the
engine's verification keeps exact (engine/speculative.py). Window rows below a request's `window_from`
(a recompute after a hit) are absent for this layer as for the others; its first row after them waits
for a state the main model has computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.engine.model.gpu.decode_graphs import DecodeGraphs
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.request import Request
from v4serve.kernels.attention import RowLayout, upload


@dataclass(frozen=True)
class MTPRows:
    """A request's rows of a pass whose tokens are kept: `count` rows from `offset`, at positions from
    `start` (its computed tokens before the pass), and where its cache is."""

    slot: int
    start: int
    offset: int
    count: int
    block_table: tuple[int, ...]
    frozen_until: int
    window_from: int

    @classmethod
    def of(cls, request: Request, offset: int, count: int) -> MTPRows:
        kv = request.kv
        assert kv.slot is not None
        return cls(kv.slot, request.num_computed_tokens, offset, count, tuple(kv.block_table), kv.frozen_until,
                   kv.window_from)


@dataclass(frozen=True)
class MTPSeed:
    """What drafting for one request starts from: the layer's next position (N-1), the token there (the
    last sampled), and where its cache is."""

    slot: int
    start: int
    token: int
    block_table: tuple[int, ...]
    frozen_until: int
    window_from: int

    @classmethod
    def of(cls, request: Request) -> MTPSeed:
        kv = request.kv
        assert kv.slot is not None
        last = request.num_tokens - 1
        return cls(kv.slot, request.num_computed_tokens - 1, request.token_slice(last, last + 1)[0],
                   tuple(kv.block_table), kv.frozen_until, kv.window_from)

    def chunk(self, ahead: int) -> SeqChunk:
        return SeqChunk(slot=self.slot, block_table=list(self.block_table), start=self.start + ahead, num_new=1,
                        frozen_until=self.frozen_until, window_from=self.window_from)


class MTPLayer:
    """The first MTP layer over a `DeviceKV` whose last layer is its own: the same on every rank.

    `row_width`: a drafted pass's rows per sequence; passes of at most that many rows per sequence run
    row-wise (kernels/attention.py `RowWrites`), as the main model's drafted passes do. With `graphs`
    (decode graphs of this layer: `DecodeGraphs(..., mtp=True)`) they and each drafting pass run from
    static buffers (captured as CUDA graphs on a GPU)."""

    def __init__(self, model: DeepseekV4, device_kv: DeviceKV, row_width: int = 1) -> None:
        self.model, self.device_kv = model, device_kv
        self.kv = device_kv.layers[model.cfg.num_layers]
        assert self.kv.hidden is not None, "the KV layout has no multi-token-prediction layer"
        self.window = self.kv.layout.window
        self.row_width = row_width
        self.graphs: DecodeGraphs | None = None

    def commit(self, parts: Sequence[MTPRows], states: torch.Tensor, ids: torch.Tensor) -> None:
        """Feed the layer the positions a pass's kept rows complete: states [T, hc, D] and ids [T] of
        the pass. Row p of the layer takes h_p and token p+1, so a request's rows at positions a..b-1
        give the layer positions a-1..b-2 (h_{a-1} from the slot), and h_{b-1} waits in the slot."""
        hidden = self.kv.hidden
        assert hidden is not None
        seqs, h_parts, id_parts = [], [], []
        for part in parts:
            a, o, n = part.start, part.offset, part.count
            has_prev = a >= 1 and a - 1 >= part.window_from  # h_{a-1} is in the slot
            first = a - 1 if has_prev else a
            count = a + n - 1 - first
            if count:
                if has_prev:
                    h_parts.append(hidden[part.slot].unsqueeze(0).to(states.dtype))
                h_parts.append(states[o:o + n - 1])
                id_parts.append(ids[o + int(not has_prev):o + n])
                seqs.append(SeqChunk(slot=part.slot, block_table=list(part.block_table), start=first, num_new=count,
                                     frozen_until=part.frozen_until, window_from=part.window_from))
        if seqs:
            self._forward(torch.cat(h_parts), torch.cat(id_parts), seqs, [range(0)] * len(seqs))
        slots = upload([part.slot for part in parts], states.device)
        last = upload([part.offset + part.count - 1 for part in parts], states.device)
        hidden.index_copy_(0, slots, states.index_select(0, last).to(hidden.dtype))

    def propose(self, seeds: Sequence[MTPSeed], k: int) -> torch.Tensor:
        """The layer's k greedy guesses after each seed → [R, k] token ids (on the device). The window
        rows the guesses beyond the first write (positions N .. N+k-2) are put back afterwards."""
        hidden, window = self.kv.hidden, self.kv.window
        assert hidden is not None
        device = hidden.device
        ahead = [(seed.slot, (seed.start + j) % self.window) for seed in seeds for j in range(1, k)]
        saved = None
        if ahead:
            row_slots, row_rows = (upload(list(col), device) for col in zip(*ahead, strict=True))
            saved = window[row_slots, row_rows]  # a copy (advanced indexing)
        h = hidden.index_select(0, upload([seed.slot for seed in seeds], device))
        ids = upload([seed.token for seed in seeds], device)
        guesses = []
        for j in range(k):
            logits, h = self._forward(h, ids, [seed.chunk(j) for seed in seeds], None)
            ids = logits.argmax(-1)
            guesses.append(ids)
        if saved is not None:
            window[row_slots, row_rows] = saved
        return torch.stack(guesses, dim=1)

    def _forward(self, h: torch.Tensor, ids: torch.Tensor, seqs: list[SeqChunk], logit_rows: list[range] | None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer over rows of `seqs` (h [T, hc, D], ids [T]) → logits of `logit_rows` (default: each
        sequence's last row) and the output states of the T rows."""
        if self.graphs is not None and self.graphs.fits(seqs):
            out = self.graphs.run(ids, seqs, logit_rows=logit_rows, h=h)
            assert out.states is not None
            rows = out.states[:len(ids)] if out.offsets == list(range(len(ids))) else out.states.index_select(
                0, upload([o + j for o, s in zip(out.offsets, seqs, strict=True) for j in range(s.num_new)],
                          ids.device))
            return out.logits, rows
        meta = AttentionMetadata.build(seqs, logit_rows)
        if 1 < max(s.num_new for s in seqs) <= self.row_width:
            meta.rowwise = RowLayout(self.row_width)
        return self.model.forward_mtp(h, ids, meta, self.device_kv)


def mtp_drafts(request: Request, most: int) -> list[int]:
    """The scheduler's drafter: what the layer proposed for the request's current tokens."""
    return request.mtp_drafts[:most] if request.mtp_drafts_at == request.num_tokens else []


def mtp_ready(request: Request) -> bool:
    """Whether the layer can draft for the request now: everything but its last token computed."""
    return request.kv.slot is not None and request.num_computed_tokens == request.num_tokens - 1
