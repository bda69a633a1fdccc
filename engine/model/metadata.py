"""What one forward step needs to know about each sequence in the batch.

The model reads and writes KV only through this object and `v4serve.cache.device_kv.DeviceKV`: the
sequence's State Cache slot, its block table, and where its new tokens sit.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch

from v4serve.cache.state_capture import StateCapture
from v4serve.kernels.attention import RaggedBatch, RowLayout, SlotTables


@dataclass(frozen=True)
class StepAbilities:
    """What a model's step can do, which the engine plans by: None where it can, else why it cannot (the
    engine refuses a setting that needs it with that reason, or says why it is off)."""
    graphs: str | None = None  # a captured decode step (CUDA graphs)
    speculation: str | None = None  # drafted passes
    parallel: str | None = None  # tensor/expert parallel ranks
    batch_invariant: str | None = None  # per-row kernels
    fp8_keys: str | None = None  # --kv-cache-dtype fp8 (V4's FP8 key records)
    # The step hands the rows it writes into slot rings to a StateCapture, so snapshots may fall inside a
    # prefill chunk; without it chunks end on them.
    captures_rows: bool = True


@dataclass
class SeqChunk:
    slot: int
    block_table: list[int]
    start: int  # position of the first new token (= tokens already computed)
    num_new: int
    offset: int = 0  # index of the first new token in the flattened batch
    # Compressed entries covering tokens below this position already sit in the Block Cache
    # (a prefix hit): they are read, never written again.
    frozen_until: int = 0
    # Window KV below this position is absent (recompute from an empty state after a hit).
    window_from: int = 0
    # The tokens just before `start`, up to N − 1 of them: DeepSeek-V4.1's Engram hashes the n-grams
    # ending at each new token (V4 reads none).
    history: tuple[int, ...] = ()

    @property
    def end(self) -> int:
        return self.start + self.num_new


@dataclass
class AttentionMetadata:
    seqs: list[SeqChunk]
    # Flattened-batch rows whose logits are wanted (usually each sequence's last new token).
    logits_rows: list[int] = field(default_factory=list)
    # Block tables padded to this many blocks (None: the longest in the batch); fixed, it makes a
    # decode step's shapes independent of the context.
    table_width: int | None = None
    # Sequences whose chunks cross snapshot points: every layer hands it the rows it writes into
    # the slot rings (cache/state_capture.py). Set for the local forward only, never sent to ranks.
    capture: StateCapture | None = None
    # The slots' block tables kept on the device (`SlotTables`, up to date with `seqs`): the step's tables
    # are gathered there instead of sent. Local, like `capture`.
    slot_tables: SlotTables | None = None
    # Run the step row by row (kernels/attention.py `RowWrites`): a drafted pass's few rows per sequence
    # at shapes that do not depend on where its sequences are, as a captured step needs.
    rowwise: RowLayout | None = None

    @classmethod
    def build(cls, seqs: list[SeqChunk], logit_rows: Sequence[Iterable[int]] | None = None) -> AttentionMetadata:
        """Lay the sequences' chunks out one after another in the flattened batch; `logit_rows[i]`
        are the rows of sequence i, counted from its first new token, whose logits are wanted
        (default: its last one)."""
        offset = 0
        rows: list[int] = []
        for i, seq in enumerate(seqs):
            seq.offset = offset
            wanted = [seq.num_new - 1] if logit_rows is None else logit_rows[i]
            rows.extend(offset + j for j in wanted)
            offset += seq.num_new
        return cls(seqs=seqs, logits_rows=rows)

    def ragged(self, device: torch.device | str) -> RaggedBatch:
        """The same layout as tensors for the attention kernels."""
        s = self.seqs
        return RaggedBatch.build([q.slot for q in s], [q.start for q in s], [q.num_new for q in s],
                                 [q.window_from for q in s], [q.block_table for q in s], device,
                                 [q.frozen_until for q in s], self.table_width, self.slot_tables, self.rowwise)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)
