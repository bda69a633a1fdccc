"""Run one sequence through the model with its own private KV storage: the simplest driver of
the incremental forward (tests, benchmarks, the transformers parity check)."""

from __future__ import annotations

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout, KVRecord
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.model import DeepseekV4


class SingleSequence:
    def __init__(self, model: DeepseekV4, max_tokens: int, record: KVRecord | None = None) -> None:
        """`record`: keys stored as FP8 records (`--kv-cache-dtype fp8`); None keeps the model dtype."""
        cfg = model.cfg
        self.model = model
        num_blocks = -(-max_tokens // cfg.block_size) + 1
        self.device_kv = DeviceKV(KVLayout.from_config(cfg, record), num_slots=1, num_blocks=num_blocks,
                                 device=next(model.parameters()).device)
        self.block_table = list(range(num_blocks))
        self.num_computed = 0

    def step(self, token_ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Compute the next chunk of tokens → logits [len, V] (or [1, V] for the last token)."""
        chunk = SeqChunk(slot=0, block_table=self.block_table, start=self.num_computed, num_new=len(token_ids))
        meta = AttentionMetadata.build([chunk], [range(len(token_ids))] if all_logits else None)
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device_kv.device)
        logits = self.model(ids, meta, self.device_kv)
        self.num_computed += len(token_ids)
        return logits

    def prefill(self, token_ids: list[int], chunk: int | None = None) -> torch.Tensor:
        """All prompt logits [len, V], computed in chunks of `chunk` tokens (default: one)."""
        size = chunk or len(token_ids)
        parts = [self.step(token_ids[i:i + size], all_logits=True) for i in range(0, len(token_ids), size)]
        return torch.cat(parts)
