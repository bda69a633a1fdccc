"""Row-wise steps (kernels/attention.py `RowWrites`): a drafted pass's few rows per sequence run as
decodes of their own positions, with no loop over sequences on the host, so that a captured step can
run them. Checked against the same rows as prefill chunks: the logits (fp32 noise, same greedy
tokens) and every KV byte written (window rings, pending compressor rows, entries, indexer keys), on
the torch and Triton kernels, at window and compression edges (window 8, ratios 4 and 16, top-k 6),
one step after another, with rows of one, two and three per sequence; padding rows (a static step's
filler) write nothing but the scratch slot and block. At DeepSeek-V4-Flash's shapes on the meta
device, a row-wise step at a fixed table width issues the same launches whatever its contexts."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.helpers import requires_triton
from tests.test_decode_graphs import CONTEXTS, setup, without_scratch
from tests.test_fixed_shapes import model_and_kv
from v4serve.engine.model.gpu.aot import Step, run_step
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.kernels.attention import RowLayout
from v4serve.kernels.launches import StepTrace

WIDTH = 3
# (sequences, rows of each): a window edge (8) and ratio-4 edges are crossed by every sequence's rows
# within the three steps, and 23 → 24 → 25 crosses top-k 6's edge.
STEPS = [([0, 2, 4], [3, 1, 2]), ([1, 3, 4, 5], [2, 3, 3, 1]), ([0, 1, 2, 3, 4, 5], [3, 3, 3, 3, 3, 3])]


def close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-4, atol=1e-4, msg=what)


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_a_rowwise_step_is_the_chunked_step(backend: str) -> None:
    model, kv, tables, _ = setup(backend)
    chunked_kv, rowwise_kv = copy.deepcopy(kv), copy.deepcopy(kv)
    positions = list(CONTEXTS)
    gen = torch.Generator().manual_seed(5)
    for rows, counts in STEPS:
        seqs = [SeqChunk(slot=i, block_table=tables[i], start=positions[i], num_new=n)
                for i, n in zip(rows, counts, strict=True)]
        ids = torch.randint(0, model.cfg.vocab_size, (sum(counts),), generator=gen)
        every_row = [range(n) for n in counts]
        want = model(ids, AttentionMetadata.build(copy.deepcopy(seqs), every_row), chunked_kv)
        meta = AttentionMetadata.build(copy.deepcopy(seqs), every_row)
        meta.rowwise = RowLayout(WIDTH)
        got = model(ids, meta, rowwise_kv)
        close(got, want, f"logits {rows}")
        assert torch.equal(got.argmax(-1), want.argmax(-1))
        for (name, a), (_, b) in zip(without_scratch(rowwise_kv), without_scratch(chunked_kv), strict=True):
            close(a, b, f"{name} after {rows}")
        for i, n in zip(rows, counts, strict=True):
            positions[i] += n


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_padding_rows_write_only_the_scratch_slot(backend: str) -> None:
    """Every sequence brings WIDTH rows, its last ones padding: the real rows' logits and every byte
    outside the scratch slot and block are those of the unpadded chunks."""
    model, kv, tables, _ = setup(backend)
    scratch_slot, scratch_block = len(CONTEXTS), kv.num_blocks - 1
    chunked_kv, padded_kv = copy.deepcopy(kv), copy.deepcopy(kv)
    rows, counts = [0, 2, 3, 5], [1, 2, 3, 2]
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(0, model.cfg.vocab_size, (sum(counts),), generator=gen)
    seqs = [SeqChunk(slot=i, block_table=tables[i], start=CONTEXTS[i], num_new=n)
            for i, n in zip(rows, counts, strict=True)]
    want = model(ids, AttentionMetadata.build(seqs, [range(n) for n in counts]), chunked_kv)
    padded_ids, at = [], 0
    for n in counts:
        padded_ids += ids[at:at + n].tolist() + [7] * (WIDTH - n)
        at += n
    padded = [SeqChunk(slot=i, block_table=tables[i], start=CONTEXTS[i], num_new=WIDTH) for i in rows]
    meta = AttentionMetadata.build(padded, [range(n) for n in counts])
    meta.rowwise = RowLayout(WIDTH, tuple(WIDTH - n for n in counts), scratch_slot, scratch_block)
    before = copy.deepcopy(padded_kv)
    got = model(torch.tensor(padded_ids), meta, padded_kv)
    close(got, want, "logits")
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    for (name, a), (_, b) in zip(without_scratch(padded_kv), without_scratch(chunked_kv), strict=True):
        close(a, b, name)
    # The ring rows a padding row would have written in its sequence's slot (its window key, its
    # compressors' pending rows) are as they were; the real rows' are not.
    checked = 0
    for layer, old in zip(padded_kv.layers, before.layers, strict=True):
        for ring in ("window", "pending_kv", "index_pending_kv"):
            new_rows, old_rows = getattr(layer, ring), getattr(old, ring)
            if new_rows is None:
                continue
            size = new_rows.shape[1]
            for slot, n in zip(rows, counts, strict=True):
                for j in range(WIDTH):
                    at = (CONTEXTS[slot] + j) % size
                    assert torch.equal(new_rows[slot, at], old_rows[slot, at]) == (j >= n), (ring, slot, j)
                    checked += 1
    assert checked > 3 * len(rows) * WIDTH


def test_more_rows_than_the_width_are_refused() -> None:
    meta = AttentionMetadata.build([SeqChunk(slot=0, block_table=[0], start=0, num_new=4)])
    meta.rowwise = RowLayout(3)
    with pytest.raises(ValueError, match="at most 3 rows per sequence, got 4"):
        meta.ragged("cpu")


def trace(contexts: tuple[int, ...], rows: int) -> list[tuple[object, ...]]:
    model, kv = model_and_kv("auto")
    with StepTrace() as t:
        run_step(model, kv, Step("drafted", chunks=tuple((c, rows) for c in contexts), rows=rows), table_width=512)
    return t.events


@requires_triton
def test_at_a_fixed_table_width_a_rowwise_step_is_the_same_whatever_the_context() -> None:
    first = trace((300, 300, 300, 300), 2)
    for contexts in [(8190, 8190, 8190, 8190), (126, 127, 128, 4097), (1, 2046, 2047, 8000)]:
        assert trace(contexts, 2) == first, contexts
    assert trace((300, 300, 300, 300), 3) != first  # the trace sees the rows: the check can fail
