"""Drafts from DeepSeek-V4's multi-token-prediction (MTP) layer.

The layer at position p reads the main model's last state there (h_p, its streams before the head) and
the embedding of token p+1, and guesses token p+2 through the shared head (engine/model/model.py
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
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.model import DeepseekV4
from v4serve.engine.request import Request
from v4serve.kernels.attention import upload


@dataclass(frozen=True)
class PassRows:
    """A request's rows in a forward pass whose tokens are kept: `count` rows from `offset`, at
    positions from the request's `num_computed_tokens` (not advanced yet)."""

    request: Request
    offset: int
    count: int


class MTPDrafter:
    def __init__(self, model: DeepseekV4, device_kv: DeviceKV, num_drafts: int) -> None:
        self.model, self.device_kv, self.num_drafts = model, device_kv, num_drafts
        self.layer = device_kv.layers[model.cfg.num_layers]
        assert self.layer.hidden is not None, "the KV layout has no multi-token-prediction layer"
        self.window = self.layer.layout.window

    def commit(self, parts: Sequence[PassRows], states: torch.Tensor, ids: torch.Tensor) -> None:
        """Feed the layer the positions a pass's kept rows complete: states [T, hc, D] and ids [T] of
        the pass. Row p of the layer takes h_p and token p+1, so a request's rows at positions a..b-1
        give the layer positions a-1..b-2 (h_{a-1} from the slot), and h_{b-1} waits in the slot."""
        hidden = self.layer.hidden
        assert hidden is not None
        seqs, h_parts, id_parts = [], [], []
        for part in parts:
            kv, a, o, n = part.request.kv, part.request.num_computed_tokens, part.offset, part.count
            assert kv.slot is not None
            has_prev = a >= 1 and a - 1 >= kv.window_from  # h_{a-1} is in the slot
            first = a - 1 if has_prev else a
            count = a + n - 1 - first
            if count:
                if has_prev:
                    h_parts.append(hidden[kv.slot].unsqueeze(0).to(states.dtype))
                h_parts.append(states[o:o + n - 1])
                id_parts.append(ids[o + int(not has_prev):o + n])
                seqs.append(SeqChunk(slot=kv.slot, block_table=kv.block_table, start=first, num_new=count,
                                     frozen_until=kv.frozen_until, window_from=kv.window_from))
        if seqs:
            meta = AttentionMetadata.build(seqs, [range(0)] * len(seqs))
            self.model.forward_mtp(torch.cat(h_parts), torch.cat(id_parts), meta, self.device_kv)
        slots = upload([part.request.kv.slot for part in parts], states.device)
        last = upload([part.offset + part.count - 1 for part in parts], states.device)
        hidden.index_copy_(0, slots, states.index_select(0, last).to(hidden.dtype))

    def propose(self, requests: Sequence[Request]) -> None:
        """Draft `num_drafts` tokens for each request whose only uncomputed token is its last (sampled)
        one; they are kept on the request with the token count they follow (`Request.mtp_drafts`)."""
        if not requests:
            return
        hidden, window = self.layer.hidden, self.layer.window
        assert hidden is not None
        device = hidden.device
        slots = [r.kv.slot for r in requests]
        starts = [r.num_computed_tokens - 1 for r in requests]  # N-1: the layer's next position
        # Rows the guesses beyond N-1 overwrite (positions N .. N+k-2), put back afterwards.
        ahead = [(s, (p + j) % self.window) for s, p in zip(slots, starts, strict=True)
                 for j in range(1, self.num_drafts)]
        saved = None
        if ahead:
            row_slots, row_rows = (upload(list(col), device) for col in zip(*ahead, strict=True))
            saved = window[row_slots, row_rows]  # a copy (advanced indexing)
        h = hidden.index_select(0, upload(slots, device))
        ids = upload([r.all_token_ids[-1] for r in requests], device)
        guesses = []
        for j in range(self.num_drafts):
            seqs = [SeqChunk(slot=r.kv.slot, block_table=r.kv.block_table, start=p + j, num_new=1,  # type: ignore[arg-type]
                             frozen_until=r.kv.frozen_until, window_from=r.kv.window_from)
                    for r, p in zip(requests, starts, strict=True)]
            logits, h = self.model.forward_mtp(h, ids, AttentionMetadata.build(seqs), self.device_kv)
            ids = logits.argmax(-1)
            guesses.append(ids)
        if saved is not None:
            window[row_slots, row_rows] = saved
        drafts = torch.stack(guesses, dim=1).tolist()  # one wait for the device, for every request
        for r, d in zip(requests, drafts, strict=True):
            r.mtp_drafts, r.mtp_drafts_at = d, r.num_tokens

    @staticmethod
    def drafts(request: Request, most: int) -> list[int]:
        """The scheduler's drafter: what `propose` left for the request's current tokens."""
        return request.mtp_drafts[:most] if request.mtp_drafts_at == request.num_tokens else []

    @staticmethod
    def ready(request: Request) -> bool:
        """Whether the layer can draft for the request now: everything but its last token computed."""
        return request.kv.slot is not None and request.num_computed_tokens == request.num_tokens - 1
