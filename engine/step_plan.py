"""What a parallel engine's rank 0 sends its other ranks each step, and the KV writes it mirrors.

Under tensor/expert parallelism (engine/process/rank_group.py runs the ranks) every rank runs the
same forward pass; what only rank 0 does — the KV manager's slot clears, snapshot restores and
blocks read from the SSD store — reaches the others as recorded writes in each step's `StepPlan`,
so every rank holds the same KV bytes (`kv_digest` checks it). The engine drives the ranks through
`Ranks`, whatever starts them.

A decode step that runs from the decode graphs' static buffers (engine/model/gpu/decode_graphs.py,
captured as CUDA graphs on every rank) and has no KV writes to mirror is sent as a `DecodeStep`
instead: token ids, positions, slots and the block-table entries that changed, packed into the
fixed-size int32 `Wire` every broadcast starts with. One broadcast, nothing pickled: what a
captured step needs to change is all it carries.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout
from v4serve.engine.model.metadata import AttentionMetadata
from v4serve.engine.mtp import MTPRows, MTPSeed

PARALLEL_STEP_TOKENS = 128  # steps with at least this many tokens use every intra-op CPU thread


def step_threads(num_tokens: int, max_threads: int) -> int:
    """CPU intra-op threads for a step: small (decode) steps run on one, the others would only spin
    against the serving threads; large (prefill) steps use them all."""
    return max_threads if num_tokens >= PARALLEL_STEP_TOKENS else 1


@dataclass(frozen=True)
class KVShape:
    """Enough for a worker to allocate a `DeviceKV` identical to rank 0's."""

    layout: KVLayout
    num_slots: int
    num_blocks: int
    dtype: torch.dtype
    row_width: int = 1  # drafted passes' rows per sequence: the MTP layer's passes that run row-wise


@dataclass(frozen=True)
class GraphSpec:
    """Decode steps from static buffers on every rank, alike (captured as CUDA graphs where `capture`:
    the collectives inside a capture meet only if every rank captures the same buckets in the same
    order). The slots' block tables live on each rank's device, kept equal by the writes each step
    carries."""

    buckets: tuple[int, ...]
    table_width: int
    scratch_slot: int
    scratch_block: int
    capture: bool
    row_width: int = 1  # drafted passes' rows per sequence (`DecodeGraphs`), 1 without speculation
    states: bool = False  # keep every row's last state (for the MTP layer)


TableWrites = tuple[list[int], list[int]]  # `SlotTables` entries (flat indices) and their new values


@dataclass
class StepPlan:
    kv_writes: list[tuple[str, tuple[Any, ...]]]  # `MirroredDeviceKV` calls, in order
    input_ids: list[int]
    meta: AttentionMetadata
    threads: int
    mtp_rows: list[MTPRows] = field(default_factory=list)  # the MTP layer takes them right after the pass
    table_writes: TableWrites = field(default_factory=lambda: ([], []))  # applied first (only under a GraphSpec)
    static: bool = False  # run from the decode graphs' buffers, as rank 0 does (its collectives' shapes)
    # Tokens still in flight (async scheduling): their places in `input_ids` and their rows in the
    # tokens rank 0 broadcasts right after this plan.
    fill: tuple[list[int], list[int]] = field(default_factory=lambda: ([], []))
    keep: list[int] = field(default_factory=list)  # slots every rank keeps before the pass (drafted)


@dataclass
class DecodeStep:
    """A static step with nothing else to mirror: what `Wire` carries. A decode step (one token per
    sequence) or a drafted pass (`num_new` rows per sequence, their tokens flattened in `input_ids`)."""

    input_ids: list[int]
    slots: list[int]
    starts: list[int]
    window_from: list[int]
    frozen_until: list[int]
    fill_rows: list[int]  # each sequence's row of the tokens in flight (rank 0 broadcasts them next), or -1
    table_writes: TableWrites
    threads: int
    num_new: list[int] = field(default_factory=list)  # rows per sequence (empty: one each)
    keep: list[int] = field(default_factory=list)  # 1 for each sequence whose slot is kept first (drafted)

    @property
    def kept_slots(self) -> list[int]:
        return [slot for slot, kept in zip(self.slots, self.keep, strict=False) if kept]

    @property
    def rows(self) -> list[int]:
        return self.num_new or [1] * len(self.slots)

    @property
    def fill(self) -> tuple[list[int], list[int]]:
        """(places in `input_ids`, rows of the tokens in flight), as `StepPlan.fill` (decode steps only:
        a drafted pass never has a token in flight)."""
        places = [i for i, row in enumerate(self.fill_rows) if row >= 0]
        return places, [self.fill_rows[i] for i in places]


class Wire:
    """The fixed-size message that opens every broadcast from rank 0 (a collective's sizes must
    match on every rank, so it never changes size between `GraphSpec`s): a header — kind, sequences,
    table entries, threads — then, for a `DecodeStep`, its fields at fixed places: the token ids
    (room for `row_width` per sequence), then per sequence its rows, whether its slot is kept, slot,
    start, window floor, frozen entries and token in flight, then the table writes. An object message
    is this header and a pickled object after it."""

    HEADER = 4
    OBJECT, DECODE, MTP_COMMIT, MTP_PROPOSE = 0, 1, 2, 3
    PER_SEQ = 9  # fields per sequence after the token ids (the table writes' two included)
    MTP_FIELDS = 6  # per sequence of an `MTPPass` (fewer than a decode step's: it always fits)

    def __init__(self, max_seqs: int = 0, row_width: int = 1) -> None:
        self.max_seqs = max_seqs  # also the table entries it holds: a decode step adds at most a block each
        self.row_width = row_width
        self.buffer = torch.zeros(self.HEADER + (row_width + self.PER_SEQ) * max_seqs, dtype=torch.int32)

    def fits(self, step: DecodeStep) -> bool:
        return (len(step.slots) <= self.max_seqs and len(step.table_writes[0]) <= self.max_seqs
                and max(step.rows, default=1) <= self.row_width)

    def object_header(self) -> torch.Tensor:
        self.buffer[0] = self.OBJECT
        return self.buffer

    def encode(self, step: DecodeStep) -> torch.Tensor:
        n, m, c = len(step.slots), len(step.table_writes[0]), self.max_seqs
        assert self.fits(step)
        values = [self.DECODE, n, m, step.threads]
        values += step.input_ids + [0] * (c * self.row_width - len(step.input_ids))
        keep = step.keep or [0] * n
        for part in (step.rows, keep, step.slots, step.starts, step.window_from, step.frozen_until, step.fill_rows):
            values += part + [0] * (c - n)
        values += step.table_writes[0] + [0] * (c - m) + step.table_writes[1]
        self.buffer[:len(values)] = torch.tensor(values, dtype=torch.int32)
        return self.buffer

    def decode(self) -> DecodeStep:
        values, c = self.buffer.tolist(), self.max_seqs
        kind, n, m, threads = values[:self.HEADER]
        assert kind == self.DECODE
        at = self.HEADER + c * self.row_width
        part = [values[at + i * c:at + i * c + n] for i in range(7)]
        rows, keep = part.pop(0), part.pop(0)
        ids = values[self.HEADER:self.HEADER + sum(rows)]
        where = values[at + 7 * c:at + 7 * c + m]
        return DecodeStep(ids, *part, (where, values[at + 8 * c:at + 8 * c + m]), threads,
                          rows if any(r != 1 for r in rows) else [], keep if any(keep) else [])

    def fits_mtp(self, work: MTPPass, table_width: int) -> bool:
        """Whether MTP work travels here: nothing to mirror first, and every pass of it one the MTP
        layer's decode graphs run (so every rank reads its block tables from its slots' rows, never from
        the message): at most `max_seqs` sequences, tables within `table_width`, rows within the width."""
        parts = work.rows or work.seeds
        return (not work.kv_writes and 0 < len(parts) <= self.max_seqs
                and all(len(p.block_table) <= table_width for p in parts)
                and all(r.count <= self.row_width for r in work.rows))

    def encode_mtp(self, work: MTPPass) -> torch.Tensor:
        """Header (kind, sequences, k), then per sequence, field by field: slot, start, the row offset
        (commit) or the seed's token (propose), the row count, frozen entries and window floor."""
        parts, c = work.rows or work.seeds, self.max_seqs
        values = [self.MTP_COMMIT if work.rows else self.MTP_PROPOSE, len(parts), work.k, 0]
        columns = ([[r.slot for r in work.rows], [r.start for r in work.rows], [r.offset for r in work.rows],
                    [r.count for r in work.rows]] if work.rows else
                   [[s.slot for s in work.seeds], [s.start for s in work.seeds], [s.token for s in work.seeds],
                    [1] * len(work.seeds)])
        columns += [[p.frozen_until for p in parts], [p.window_from for p in parts]]
        for column in columns:
            values += column + [0] * (c - len(parts))
        self.buffer[:len(values)] = torch.tensor(values, dtype=torch.int32)
        return self.buffer

    def decode_mtp(self) -> MTPPass:
        """The MTP work sent, its block tables left empty: the decode graphs read the slots' rows."""
        values, c = self.buffer.tolist(), self.max_seqs
        kind, n, k, _ = values[:self.HEADER]
        slot, start, third, count, frozen, floor = (values[self.HEADER + i * c:self.HEADER + i * c + n]
                                                    for i in range(self.MTP_FIELDS))
        fields = list(zip(slot, start, third, count, frozen, floor, strict=True))
        if kind == self.MTP_COMMIT:
            return MTPPass([], rows=[MTPRows(a, b, o, n, (), f, w) for a, b, o, n, f, w in fields])
        assert kind == self.MTP_PROPOSE
        return MTPPass([], seeds=[MTPSeed(a, b, t, (), f, w) for a, b, t, _, f, w in fields], k=k)

    @property
    def kind(self) -> int:
        return int(self.buffer[0])


@dataclass
class MTPPass:
    """MTP work rank 0 does after sampling (engine/mtp.py), for every rank to do alike: the kept rows of
    the last pass whose drafts were all kept, or drafting from `seeds`; after the KV writes so far."""

    kv_writes: list[tuple[str, tuple[Any, ...]]]
    rows: list[MTPRows] = field(default_factory=list)
    seeds: list[MTPSeed] = field(default_factory=list)
    k: int = 0


class MirroredDeviceKV(DeviceKV):
    """Rank 0's DeviceKV: every write that does not come from the model (which every rank runs) is
    also recorded, with its host data (snapshots are never changed in place; store blocks are copied
    out of their larger buffer), for the next `StepPlan`. Recorded even when the write fails part-way,
    so the ranks attempt the same writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[str, tuple[Any, ...]]] = []

    def clear_slot(self, slot: int) -> None:
        self.writes.append(("clear_slot", (slot,)))
        super().clear_slot(slot)

    def write_slot(self, slot: int, state: torch.Tensor | list[torch.Tensor]) -> None:
        host = state.to("cpu") if isinstance(state, torch.Tensor) else [t.to("cpu") for t in state]
        self.writes.append(("write_slot", (slot, host)))
        super().write_slot(slot, state)

    def restore_kept(self, slot: int) -> None:
        # Each rank puts back its own copy (`keep_slots`, which every rank runs before a drafted pass):
        # the write names the slot, nothing more.
        self.writes.append(("restore_kept", (slot,)))
        DeviceKV.write_slot(self, slot, self._kept.pop(slot))

    def install_blocks(self, block_ids: list[int], stacked: list[torch.Tensor]) -> None:
        n = len(block_ids)  # `stacked` are views of a larger host matrix: send only these rows
        self.writes.append(("install_blocks", (list(block_ids), [t[:n].to("cpu", copy=True) for t in stacked])))
        super().install_blocks(block_ids, stacked)

    def take_writes(self) -> list[tuple[str, tuple[Any, ...]]]:
        writes, self.writes = self.writes, []
        return writes


def replay_writes(kv: DeviceKV, writes: list[tuple[str, tuple[Any, ...]]]) -> None:
    for name, args in writes:
        getattr(DeviceKV, name)(kv, *args)


def kv_digest(kv: DeviceKV) -> str:
    h = hashlib.sha256()
    for layer in kv.layers:
        for t in (*layer.slot_tensors(), *layer.block_tensors()):
            h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class Ranks(Protocol):
    """The other ranks of a parallel engine, as rank 0's engine drives them."""

    broken: bool  # a step failed part-way: the ranks may wait in different collectives

    def start(self, shape: KVShape) -> None:
        """Workers allocate their DeviceKV like rank 0's."""

    def run_step(self, plan: StepPlan) -> None:
        """Send the step; the caller then runs the same forward pass as every worker."""

    def run_decode(self, step: DecodeStep) -> bool:
        """Send a static decode step in one fixed-size message; False (nothing sent) where it does not
        fit one (send it as a `StepPlan`)."""

    def start_graphs(self, spec: GraphSpec) -> None:
        """Every rank builds (and captures) the same decode graphs as rank 0 is about to."""

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """The tokens in flight the step just sent places (on the device: a broadcast over the model's
        group, queued behind their sampling)."""

    def run_mtp(self, work: MTPPass) -> None:
        """Send MTP work; the caller then does the same as every worker."""

    def kv_digests(self, kv: MirroredDeviceKV) -> list[str]:
        """sha256 of every rank's whole DeviceKV, rank 0 first."""

    def dead_rank(self) -> str | None:
        """Which rank has exited, and how; None while all run."""

    def kill(self) -> None: ...

    def stop(self) -> None:
        """Workers leave their loop and exit; then the group is torn down."""
