"""Sparse attention of DeepSeek-V4 over a ragged batch (prefill chunks and decodes together).

Each query at position p attends to
- its window: positions [lo, p] with lo = max(p − W + 1, window_from, 0); keys below the
  sequence's `start` come from its State Cache ring (row j mod W), the rest from this step's
  new keys `kv` (a prefill chunk's keys reach the ring only after attention, so nothing it
  needs is overwritten; a decode-only step writes its ring rows first, but a decode at p reads
  row p mod W from `kv`, and that row held p − W, outside its window);
- compressed entries read through the block table: on HCA layers every visible entry
  (e < (p + 1) // m), on CSA layers the indexer's top-k (`topk` [T, k], −1 = none);
and one softmax over all of them plus a per-head sink; V = K.

`sparse_attention` is the plain-torch twin of `attention_triton.sparse_attention` (same
signature). It groups the work the way a CPU likes it: decodes in one batched pass, prefill
chunks in query tiles that share their keys.

Shapes: T = rows of the flattened batch, B = sequences, H = heads, d = head dim, W = window,
m = compress ratio, P = entries per block, k = indexer top-k.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from v4serve.kernels.kv_fp8 import Record, loaded

# Queries per tile on long chunks: bounds the window branch to O(n·(tile + W)).
ATTN_TILE = 256


@dataclass(frozen=True)
class DecodeRows:
    """The sequences decoding one token each, gathered once per step for the batched decode paths."""

    seqs: tuple[int, ...]  # indices into the batch's sequences
    rows: torch.Tensor  # [D] row of each one's token
    slots: torch.Tensor  # [D]
    positions: torch.Tensor  # [D] position of each one's token
    window_floor: torch.Tensor  # [D] lowest window position present
    frozen_until: torch.Tensor  # [D] entries below this position are already in the Block Cache
    tables: torch.Tensor  # [D, nb] their block tables


class SlotTables:
    """Each State Cache slot's block table, kept on the device between steps. A step sends only what
    changed since the last one (a request's table where it is new to the slot, the blocks added to
    it), so the host's part of the metadata does not grow with the context; the step's tables are
    gathered from these rows on the device. A table is a list that only grows while it belongs to a
    slot (`cache/` replaces it, never edits it, when a request is admitted or freed); every entry past
    a table's length is 0, as in a padded table."""

    def __init__(self, num_slots: int, max_blocks: int, device: torch.device | str) -> None:
        self.rows = torch.zeros(num_slots, max_blocks, dtype=torch.long, device=device)
        self._owner: list[list[int] | None] = [None] * num_slots  # the list each row mirrors
        self._sent = [0] * num_slots  # entries of that list the row holds
        # With a list here (`record()`), every write is also kept, for other ranks to `apply` alike.
        self._recorded: list[tuple[list[int], list[int]]] | None = None

    @property
    def max_blocks(self) -> int:
        return self.rows.shape[1]

    def update(self, slots: list[int], tables: list[list[int]]) -> None:
        """Bring the rows of `slots` to `tables` (one non-blocking copy of the changed entries)."""
        where: list[int] = []
        values: list[int] = []
        width = self.max_blocks
        for slot, table in zip(slots, tables, strict=True):
            sent, stale = self._sent[slot], 0
            if self._owner[slot] is not table:  # a new request in this slot: its whole table, the rest zeroed
                self._owner[slot] = table
                sent, stale = 0, sent
            elif len(table) == sent:
                continue  # most decode steps
            if len(table) > width:
                raise ValueError(f"a block table of {len(table)} blocks does not fit {width} (max model len)")
            base = slot * width
            where.extend(range(base + sent, base + max(len(table), stale)))
            values.extend(table[sent:])
            values.extend([0] * (stale - len(table)))
            self._sent[slot] = len(table)
        if where:
            self.apply(where, values)
            if self._recorded is not None:
                self._recorded.append((where, values))

    def apply(self, where: list[int], values: list[int]) -> None:
        """Entries `where` (flat indices into the rows) set to `values`: one upload, one scatter."""
        on = upload(where + values, self.rows.device)
        self.rows.view(-1).index_copy_(0, on[:len(where)], on[len(where):])

    def record(self) -> None:
        """From now on keep every write until `take_writes` (a parallel engine's rank 0: the other
        ranks' rows are kept equal to these by applying the same writes)."""
        self._recorded = []

    def take_writes(self) -> tuple[list[int], list[int]]:
        """The writes since the last call, as one (where, values) pair, in order (a later write of an
        entry comes after an earlier one, and `index_copy_` with repeated indices is not ordered:
        repeats keep only the last value)."""
        recorded = self._recorded
        if not recorded:
            return [], []  # most decode steps: no table changed
        if len(recorded) == 1:  # one update: its entries are distinct already
            where, values = recorded.pop()
            return where, values
        last: dict[int, int] = {}
        for where, values in recorded:
            last.update(zip(where, values, strict=True))
        recorded.clear()
        return list(last), list(last.values())


@dataclass(frozen=True)
class RaggedBatch:
    """Where each sequence's new tokens sit in a flattened batch, as tensors for kernels and as
    Python tuples for host-side loops. Built once per forward step and shared by all layers."""

    slots: tuple[int, ...]
    starts: tuple[int, ...]  # position of each sequence's first new token
    num_new: tuple[int, ...]
    offsets: tuple[int, ...]  # row of each sequence's first new token
    window_from: tuple[int, ...]  # window keys below this position are absent (recompute after a hit)
    tables: torch.Tensor  # [B, nb] block tables, padded with block 0
    row_seq: torch.Tensor  # [T] sequence of each row
    row_pos: torch.Tensor  # [T] position of each row
    seq_info: torch.Tensor  # [B, 5]: slot, start, offset, window_from, num_new (int64, for kernels)
    decodes: DecodeRows
    _memo: dict[int, Any] = field(default_factory=dict, compare=False, repr=False)

    buffer: torch.Tensor | None = field(default=None, compare=False, repr=False)  # what every tensor views
    slot_tables: SlotTables | None = field(default=None, compare=False, repr=False)  # where `tables` came from
    rows: RowWrites | None = field(default=None, compare=False, repr=False)  # a row-wise step (see `RowWrites`)

    @classmethod
    def build(cls, slots: list[int], starts: list[int], num_new: list[int], window_from: list[int],
              block_tables: list[list[int]], device: torch.device | str,
              frozen_until: list[int] | None = None, table_width: int | None = None,
              slot_tables: SlotTables | None = None, rowwise: RowLayout | None = None) -> RaggedBatch:
        """Every tensor of the step from one host buffer in one copy: pinned and non-blocking on a
        GPU, so the host goes on building the step instead of waiting for the bus. `table_width`
        pads every block table to that many blocks (default: the longest in the batch); at a fixed
        width a decode step's shapes no longer depend on the context. With `slot_tables` (brought up
        to `block_tables` by the caller) the tables are gathered on the device instead of sent.
        `rowwise`: run the step row by row (`RowWrites`)."""
        parts, offsets, width = _host_parts(slots, starts, num_new, window_from, block_tables, frozen_until,
                                            table_width, sent=slot_tables is None, rowwise=rowwise)
        on = upload([x for values in parts.values() for x in values], torch.device(device))
        views, at = {}, 0
        for name, values in parts.items():
            views[name], at = on[at:at + len(values)], at + len(values)
        b, d = len(slots), parts["decode_seqs"]
        info = views["info"].view(b, 5)
        if slot_tables is None:
            tables = views["tables"].view(b, width)
        else:
            tables = slot_tables.rows[:, :width].index_select(0, info[:, 0])
        rows = None
        if rowwise is not None:
            rows = RowWrites.of(views, rowwise.width, tables, parts)
            decodes = rows.reads
        else:
            decode_tables = tables if len(d) == b else tables[views["decode_seqs"]]
            decodes = DecodeRows(tuple(d), *views["decodes"].view(5, len(d)).unbind(0), decode_tables)
        return cls(tuple(slots), tuple(starts), tuple(num_new), tuple(offsets), tuple(window_from), tables,
                   views["row_seq"], views["row_pos"], info, decodes, buffer=on, slot_tables=slot_tables, rows=rows)

    def refill(self, slots: list[int], starts: list[int], window_from: list[int], block_tables: list[list[int]],
               frozen_until: list[int], rowwise: RowLayout | None = None) -> None:
        """Another step of the same shape (as many sequences, each decoding one token or, `rowwise`,
        as many rows each; tables as wide) into this batch's own tensors, in one non-blocking copy
        (and, from slot tables, one gather on the device): what a replayed CUDA graph reads. The
        Python tuples keep the values this batch was built with (a replay runs no Python): a forward
        whose result depended on them would differ from the eager step."""
        assert self.buffer is not None and len(slots) == len(self.slots)
        assert (rowwise is None) == (self.rows is None), "a refill keeps the batch's kind"
        width = self.tables.shape[1]
        num_new = self.num_new if rowwise is not None else [1] * len(slots)
        parts, _, _ = _host_parts(slots, starts, list(num_new), window_from, block_tables, frozen_until,
                                  width, sent=self.slot_tables is None, rowwise=rowwise)
        upload([x for values in parts.values() for x in values], self.buffer.device, out=self.buffer)
        if self.slot_tables is not None:
            torch.index_select(self.slot_tables.rows[:, :width], 0, self.seq_info[:, 0], out=self.tables)
        if self.rows is not None:
            self.rows.refresh(self.tables, self.row_seq)
        self.forget_derived()

    def forget_derived(self) -> None:
        """Drop what the last forward derived from these tensors (entry counts, a row-wise step's round
        targets): the next forward derives it again. Every forward starts here, so a CUDA graph
        captures that work too; a value kept from the warm-up runs before the capture would be replayed
        frozen, stale from the first step on."""
        self._memo.clear()

    @property
    def num_rows(self) -> int:
        return sum(self.num_new)

    @property
    def only_decodes(self) -> bool:
        return self.rows is None and len(self.decodes.seqs) == len(self.num_new)

    def entry_counts(self, ratio: int) -> torch.Tensor:
        """Compressed entries each decoding sequence can see at ratio m, (p + 1) // m [D]: computed
        once per step, shared by every layer of that ratio."""
        if ratio not in self._memo:
            self._memo[ratio] = (self.decodes.positions + 1) // ratio
        return self._memo[ratio]

    def round_targets(self, j: int) -> DecodeRows:
        """Where round j of a row-wise step writes (`RowWrites.rounds`): computed once per step."""
        key = -1 - j
        assert self.rows is not None
        if key not in self._memo:
            t, rows = self.rows.targets.decodes, self.rows.rounds[j]
            self._memo[key] = DecodeRows((), rows, *(x.index_select(0, rows) for x in (
                t.slots, t.positions, t.window_floor, t.frozen_until, t.tables)))
        return self._memo[key]

    def decode_rows(self, x: torch.Tensor) -> torch.Tensor:
        """The decoding sequences' rows of x [T, ...]: x itself when every row decodes (no gather)."""
        return x if self.only_decodes or self.rows is not None else x[self.decodes.rows]


@dataclass(frozen=True)
class RowLayout:
    """A row-wise step's shape on the host: at most `width` rows per sequence; the last `padding[b]`
    rows of sequence b are padding (a static step's filler: computed, never kept), which write into
    the scratch slot and its block `scratch_block` instead of the sequence's own."""

    width: int
    padding: tuple[int, ...] = ()
    scratch_slot: int = 0
    scratch_block: int = 0


@dataclass(frozen=True)
class RowWrites:
    """A step whose sequences each bring a few rows (a drafted pass: the last token and its drafts;
    at most `width`), run row by row as decodes are, with no loop over sequences on the host, so it
    can be captured at fixed shapes: every row attends as a decode of its own position (its window's
    rows below the sequence's start from the ring, the step's own rows above it from `kv`); the
    compressors take the rows in rounds (round j: each sequence's j-th row, so the pending rows of a
    slot are written in order); the window keys go to the rings after attention, since a sequence's
    later rows replace ring rows its earlier rows still read.

    Writes go where `targets` says: a row's own slot and position, or, for a padding row, the scratch
    slot at position `lead` (below the width, so its entries land in the scratch block)."""

    width: int
    lead: torch.Tensor  # [T] the sequence's rows before this one in the step
    reads: DecodeRows  # every row as a decode of its own sequence (the attention and indexer side)
    targets: RaggedBatch  # every row as a one-token sequence where it writes (slot, position; tables)
    padding: torch.Tensor  # [T] 1 on padding rows
    scratch_table: torch.Tensor  # [nb] the scratch slot's table
    rounds: tuple[torch.Tensor, ...]  # [rows of round j] for j < width

    @classmethod
    def of(cls, views: dict[str, torch.Tensor], width: int, tables: torch.Tensor, parts: dict[str, list[int]]
           ) -> RowWrites:
        """From `RaggedBatch.build`'s views of its buffer and the host lists they came from."""
        t = len(parts["row_seq"])
        reads_at = views["reads"].view(3, t)  # each row's sequence slot, window floor, frozen_until
        at = views["target_cols"].view(5, t)  # slot, position, row, window floor, frozen_until
        row_tables = tables.index_select(0, views["row_seq"])
        reads = DecodeRows(tuple(parts["row_seq"]), at[2], reads_at[0], views["row_pos"], reads_at[1], reads_at[2],
                           row_tables)
        padding, scratch_table = views["padding"], views["scratch_table"]
        target_tables = torch.where(padding[:, None].bool(), scratch_table[None, :], row_tables)
        host = parts["target_cols"]
        targets = RaggedBatch(tuple(host[:t]), tuple(host[t:2 * t]), (1,) * t, tuple(range(t)),
                              tuple(host[3 * t:4 * t]), target_tables, at[2], at[1], views["target_info"].view(t, 5),
                              DecodeRows(tuple(range(t)), at[2], at[0], at[1], at[3], at[4], target_tables))
        rounds, first = [], 0
        for j in range(width):
            n = parts["lead"].count(j)
            rounds.append(views["rounds"][first:first + n])
            first += n
        return cls(width, views["lead"], reads, targets, padding, scratch_table, tuple(rounds))

    def refresh(self, tables: torch.Tensor, row_seq: torch.Tensor) -> None:
        """After a refill: the per-row tables again, in place (what a replay reads)."""
        torch.index_select(tables, 0, row_seq, out=self.reads.tables)
        torch.where(self.padding[:, None].bool(), self.scratch_table[None, :], self.reads.tables,
                    out=self.targets.tables)


def _host_parts(slots: list[int], starts: list[int], num_new: list[int], window_from: list[int],
                block_tables: list[list[int]], frozen_until: list[int] | None, table_width: int | None,
                sent: bool = True, rowwise: RowLayout | None = None) -> tuple[dict[str, list[int]], list[int], int]:
    """RaggedBatch's tensors as host lists, in buffer order → (parts, row offsets, table width); the
    tables only if `sent` (else they come from slot tables on the device)."""
    offsets, total = [], 0
    for n in num_new:
        offsets.append(total)
        total += n
    b, width = len(slots), max([len(t) for t in block_tables] + [1])
    if table_width is not None:
        if table_width < width:
            raise ValueError(f"a block table of {width} blocks does not fit table_width {table_width}")
        width = table_width
    floor = [max(w, 0) for w in window_from]
    frozen = frozen_until or [0] * b
    d = [i for i, n in enumerate(num_new) if n == 1] if rowwise is None else []
    parts = {
        "tables": [x for t in block_tables for x in (*t, *[0] * (width - len(t)))] if sent else [],  # [B, nb]
        "row_seq": [i for i, n in enumerate(num_new) for _ in range(n)],  # [T]
        "row_pos": [p for s, n in zip(starts, num_new, strict=True) for p in range(s, s + n)],  # [T]
        "info": [x for row in zip(slots, starts, offsets, floor, num_new, strict=True) for x in row],  # [B, 5]
        "decodes": [offsets[i] for i in d] + [slots[i] for i in d] + [starts[i] for i in d]
                   + [floor[i] for i in d] + [frozen[i] for i in d],  # [5, D]
        "decode_seqs": d,  # [D]
    }
    if rowwise is not None:
        parts |= _row_parts(slots, starts, num_new, floor, frozen, width, rowwise)
    return parts, offsets, width


def _row_parts(slots: list[int], starts: list[int], num_new: list[int], floor: list[int], frozen: list[int],
               width: int, layout: RowLayout) -> dict[str, list[int]]:
    """A row-wise step's own tensors as host lists (`RowWrites`)."""
    if max(num_new) > layout.width:
        raise ValueError(f"a row-wise step takes at most {layout.width} rows per sequence, got {max(num_new)}")
    padding = layout.padding or (0,) * len(slots)
    lead, reads, cols, pad = [], [[], [], []], [[], [], [], [], []], []
    row = 0
    for b, n in enumerate(num_new):
        real = n - padding[b]
        for j in range(n):
            lead.append(j)
            reads[0].append(slots[b])
            reads[1].append(floor[b])
            reads[2].append(frozen[b])
            # A padding row goes to the scratch slot, below the width (its entries in the scratch block).
            target = (slots[b], starts[b] + j, row, floor[b], frozen[b]) if j < real else (layout.scratch_slot, j,
                                                                                           row, 0, 0)
            for col, x in zip(cols, target, strict=True):
                col.append(x)
            pad.append(int(j >= real))
            row += 1
    return {
        "lead": lead,  # [T]
        "reads": [x for part in reads for x in part],  # [3, T]
        "target_cols": [x for col in cols for x in col],  # [5, T] slot, position, row, window floor, frozen_until
        # [T, 5] as `RaggedBatch.seq_info` (every row a one-token sequence at its slot and position)
        "target_info": [x for s, p, r, f, _ in zip(*cols, strict=True) for x in (s, p, r, f, 1)],
        "padding": pad,  # [T]
        "scratch_table": [layout.scratch_block] + [0] * (width - 1),  # [nb]
        "rounds": sorted(range(row), key=lead.__getitem__),  # [T] rows by their place in their sequence
    }


def upload(values: list, device: torch.device, dtype: torch.dtype = torch.long,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """Host numbers → a tensor on `device` (or into `out`, a buffer there), copied without blocking
    the host on a GPU (from pinned memory)."""
    host = torch.tensor(values, dtype=dtype, pin_memory=device.type == "cuda")
    if out is None:
        return host.to(device, non_blocking=device.type != "cpu")
    return out.copy_(host, non_blocking=device.type != "cpu")


def sparse_attention(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
                     topk: torch.Tensor | None, batch: RaggedBatch, ratio: int, sink: torch.Tensor,
                     scale: float, record: Record | None = None) -> torch.Tensor:
    """q [T, H, d], kv [T, d] (this step's keys), ring [S, W, d], entries [NB, P, d] or None,
    topk [T, k] or None (CSA), sink [H] → out [T, H, d]. With an FP8 `record` layout the ring and
    entries hold records [..., bytes] instead (this step's own keys are read unquantized)."""
    if batch.rows is not None:  # every row as a decode, its sequence's earlier rows from `kv`
        return _decodes(q, kv, ring, entries, topk, batch, ratio, sink, scale, record)
    out = torch.empty_like(q)
    if batch.decodes.seqs:
        out[batch.decodes.rows] = _decodes(q, kv, ring, entries, topk, batch, ratio, sink, scale, record)
    for b, n in enumerate(batch.num_new):
        if n > 1:
            lo = batch.offsets[b]
            out[lo:lo + n] = _chunk(q, kv, ring, entries, topk, batch, b, ratio, sink, scale, record)
    return out


def attend(q: torch.Tensor, shared: torch.Tensor | None, shared_mask: torch.Tensor | None,
           picked: torch.Tensor | None, picked_mask: torch.Tensor | None, sink: torch.Tensor,
           scale: float) -> torch.Tensor:
    """The softmax itself. Keys come in two groups, either of which may be None: keys shared by the
    whole query tile with a [n, L] mask, and keys picked per query with a [n, k] mask.
    q [n, H, d]; shared [L, d]; picked [n, k, d]; sink [H] → out [n, H, d].
    Products are matmul/bmm: the same arithmetic as einsum at a fraction of its dispatch cost."""
    parts = []
    if shared is not None and shared_mask is not None:
        logits = torch.matmul(q, shared.t()).mul_(scale)  # [n, H, L]
        parts.append(logits.masked_fill_(~shared_mask[:, None, :], float("-inf")))
    if picked is not None and picked_mask is not None:
        picked = picked.to(q.dtype)
        own = torch.bmm(q, picked.transpose(1, 2)).mul_(scale)  # [n, H, k]
        parts.append(own.masked_fill_(~picked_mask[:, None, :], float("-inf")))
    assert parts, "attend needs shared or picked keys"
    parts.append(sink.view(1, -1, 1).expand(q.shape[0], -1, 1).to(parts[0].dtype))
    probs = torch.cat(parts, dim=-1).softmax(dim=-1)
    n_shared = 0 if shared is None else shared.shape[0]
    out = None if shared is None else torch.matmul(probs[..., :n_shared], shared)
    if picked is not None:
        own_out = torch.bmm(probs[..., n_shared:-1], picked)
        out = own_out if out is None else out + own_out
    assert out is not None
    return out


def gather_entries(entries: torch.Tensor, tables: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """Entries `index` [R, n] (−1 or any value where masked) of the sequences whose block tables are
    `tables` [R, nb] → [R, n, d]."""
    per_block = entries.shape[1]
    index = index.clamp(min=0)
    blocks = tables.gather(1, (index // per_block).clamp(max=tables.shape[1] - 1))
    return entries[blocks, index % per_block]


def _decodes(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
             topk: torch.Tensor | None, batch: RaggedBatch, ratio: int, sink: torch.Tensor,
             scale: float, record: Record | None) -> torch.Tensor:
    """Every sequence decoding one token: its whole ring (with its own new key at row p mod W, which
    held position p − W or, when the step wrote its rings first, already this key) plus its entries,
    as that query's own keys. In a row-wise step, a row's `lead` earlier rows of its sequence are this
    step's keys too: the ring rows they go to still hold positions W earlier (written after attention)."""
    dev, w = q.device, ring.shape[1]
    dec = batch.decodes
    rows, t, n = dec.rows, dec.positions, len(dec.seqs)
    keys = loaded(ring[dec.slots], record, q.dtype)  # [D, W, d]
    each = torch.arange(n, device=dev)
    keys[each, t % w] = kv[rows].to(q.dtype)
    if batch.rows is not None:
        lead = batch.rows.lead
        for i in range(1, batch.rows.width):
            at, earlier = (t - i) % w, (rows - i).clamp(min=0)
            keys[each, at] = torch.where((lead >= i)[:, None], kv[earlier].to(q.dtype), keys[each, at])
    ring_row = torch.arange(w, device=dev)
    held = t[:, None] - ((t[:, None] - ring_row[None, :]) % w)  # position held by each ring row
    mask = held >= dec.window_floor[:, None]
    if entries is not None:
        tables = dec.tables
        if topk is not None:
            index = topk[rows]
            visible = index >= 0
        else:
            count = (t + 1) // ratio
            index = torch.arange(int(count.max()), device=dev)[None, :].expand(n, -1)
            visible = index < count[:, None]
        keys = torch.cat([keys, loaded(gather_entries(entries, tables, index), record, q.dtype)], dim=1)
        mask = torch.cat([mask, visible], dim=1)
    return attend(q[rows], None, None, keys, mask, sink, scale)


def _chunk(q: torch.Tensor, kv: torch.Tensor, ring: torch.Tensor, entries: torch.Tensor | None,
           topk: torch.Tensor | None, batch: RaggedBatch, b: int, ratio: int, sink: torch.Tensor,
           scale: float, record: Record | None) -> torch.Tensor:
    """One sequence's prefill chunk, in tiles of queries sharing their window keys (and, on HCA
    layers, their entries)."""
    dev, w = q.device, ring.shape[1]
    start, n, first = batch.starts[b], batch.num_new[b], batch.offsets[b]
    lo = max(start - w + 1, batch.window_from[b], 0)
    held = torch.arange(lo, start, device=dev)
    keys = torch.cat([loaded(ring[batch.slots[b], held % w], record, q.dtype), kv[first:first + n].to(q.dtype)])
    key_pos = torch.arange(lo, start + n, device=dev)
    all_entries = None
    if entries is not None and topk is None:
        count = (start + n) // ratio
        index = torch.arange(count, device=dev)[None]
        all_entries = loaded(gather_entries(entries, batch.tables[b:b + 1], index)[0], record, q.dtype)
    out = torch.empty_like(q[first:first + n])
    for a in range(0, n, ATTN_TILE):
        z = min(a + ATTN_TILE, n)
        pos = torch.arange(start + a, start + z, device=dev)
        k_lo = max(start + a - w + 1 - lo, 0)
        k_hi = start + z - lo
        dist = pos[:, None] - key_pos[None, k_lo:k_hi]
        shared, mask = keys[k_lo:k_hi], (dist >= 0) & (dist < w)
        picked, picked_mask = None, None
        if all_entries is not None:
            count = (start + z) // ratio
            visible = torch.arange(count, device=dev)[None, :] < ((pos + 1) // ratio)[:, None]
            shared = torch.cat([shared, all_entries[:count].to(q.dtype)])
            mask = torch.cat([mask, visible], dim=1)
        elif entries is not None and topk is not None:
            index = topk[first + a:first + z]
            picked_mask = index >= 0
            picked = loaded(gather_entries(entries, batch.tables[b:b + 1].expand(len(index), -1), index), record,
                            q.dtype)
        out[a:z] = attend(q[first + a:first + z], shared, mask, picked, picked_mask, sink, scale)
    return out
