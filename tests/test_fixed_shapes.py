"""What a CUDA graph would freeze of a decode step: at a fixed block-table width, a DeepSeek-V4-Flash
decode step (meta device, Triton kernels, packed weights, bf16 and FP8 KV) issues the same ops and
launches, with the same shapes, grids and numbers, whatever the contexts of its sequences: one
capture per batch size could serve every step. Without the fixed width the traces differ (the
table's width reaches the indexer's entry count, grid and tile), so the check can fail."""

from __future__ import annotations

import copy
from functools import cache
from typing import Any

import pytest
import torch

from tests.helpers import SMALL, requires_triton
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout, key_record
from v4serve.engine.model.gpu.aot import Scenario, Step, meta_model, run_step
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.kernels.launches import StepTrace
from v4serve.kernels.registry import load_kernels

pytestmark = requires_triton

MAX_CONTEXT = 8192
BATCH = 4


@cache
def model_and_kv(kv_cache_dtype: str) -> tuple[Any, DeviceKV]:
    model = meta_model(Scenario("deepseek-v4-flash", kv_cache_dtype))
    cfg = model.cfg
    record = key_record(cfg.head_dim, cfg.rope_dim, "bfloat16", kv_cache_dtype)
    blocks = BATCH * -(-(MAX_CONTEXT + 1) // cfg.block_size)
    kv = DeviceKV(KVLayout.from_config(cfg, record), num_slots=BATCH, num_blocks=blocks, dtype=torch.bfloat16,
                  device="meta")
    return model, kv


def trace(kv_cache_dtype: str, contexts: tuple[int, ...], table_width: int | None) -> list[tuple[Any, ...]]:
    model, kv = model_and_kv(kv_cache_dtype)
    with StepTrace() as t:
        run_step(model, kv, Step("decode", decodes=contexts), table_width)
    assert any(e[0] == "launch" for e in t.events) and any(e[0] == "op" for e in t.events)
    return t.events


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_at_a_fixed_table_width_a_decode_step_is_the_same_whatever_the_context(kv_cache_dtype: str) -> None:
    model, _ = model_and_kv(kv_cache_dtype)
    width = -(-(MAX_CONTEXT + 1) // model.cfg.block_size)
    # Short and long, every sequence alike or each its own, on and off block and entry edges.
    contexts = [(300,) * BATCH, (8191,) * BATCH, (127, 128, 129, 4097), (1, 2047, 2048, 8000)]
    first = trace(kv_cache_dtype, contexts[0], width)
    for other in contexts[1:]:
        assert trace(kv_cache_dtype, other, width) == first, other


def test_without_a_fixed_width_the_context_shows_in_the_trace() -> None:
    short, long = trace("auto", (300,) * BATCH, None), trace("auto", (8191,) * BATCH, None)
    launches = {e[1] for e in short if e[0] == "launch"}
    differing = {e[1] for e, f in zip(short, long, strict=False) if e != f and e[0] == "launch"}
    assert short != long
    assert "_index_scores_kernel" in differing and "_index_scores_kernel" in launches


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_fixed_table_width_changes_no_logit(backend: str) -> None:
    """The small model (top-k 6, ratios 4 and 16, window 8): sequences that see fewer, exactly and more
    than k entries decode one step with tables as long as the batch needs and padded to 512 tokens'
    worth; the logits are bitwise the same (the extra entries are past every row's count)."""
    model = build_tiny(tiny_config(**SMALL), seed=11)
    cfg = model.cfg
    contexts = (9, 23, 24, 25, 70)  # (p + 1) // 4 against k = 6 around p = 23
    width = -(-512 // cfg.block_size)
    kv = DeviceKV(KVLayout.from_config(cfg), num_slots=len(contexts), num_blocks=len(contexts) * width)
    tables = [list(range(i * width, i * width + -(-(c + 1) // cfg.block_size))) for i, c in enumerate(contexts)]
    gen = torch.Generator().manual_seed(4)
    for i, c in enumerate(contexts):
        prompt = torch.randint(0, cfg.vocab_size, (c,), generator=gen)
        model(prompt, AttentionMetadata.build([SeqChunk(slot=i, block_table=tables[i], start=0, num_new=c)]), kv)
    ids = torch.randint(0, cfg.vocab_size, (len(contexts),), generator=gen)
    model.use_kernels(load_kernels(backend))
    logits = []
    for table_width in (None, width):
        meta = AttentionMetadata.build([SeqChunk(slot=i, block_table=tables[i], start=c, num_new=1)
                                        for i, c in enumerate(contexts)])
        meta.table_width = table_width
        logits.append(model(ids, meta, copy.deepcopy(kv)))
    assert torch.equal(logits[0], logits[1])
