"""What one forward step needs to know about each sequence in the batch.

The model reads and writes KV only through this object and `cache.storage.KVStorage`: the
sequence's State Cache slot, its block table, and where its new tokens sit.
"""

from __future__ import annotations

from dataclasses import dataclass, field


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

    @property
    def end(self) -> int:
        return self.start + self.num_new


@dataclass
class AttentionMetadata:
    seqs: list[SeqChunk]
    # Flattened-batch rows whose logits are wanted (usually each sequence's last new token).
    logits_rows: list[int] = field(default_factory=list)

    @classmethod
    def build(cls, seqs: list[SeqChunk], all_logits: bool = False) -> AttentionMetadata:
        offset = 0
        rows: list[int] = []
        for seq in seqs:
            seq.offset = offset
            offset += seq.num_new
            rows.extend(range(seq.offset, offset) if all_logits else [offset - 1])
        return cls(seqs=seqs, logits_rows=rows)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new for s in self.seqs)
