"""Paged KV access (kernels/paged.py) against plain lists, and the device tensors' sizes against the
layout's byte arithmetic."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import requires_triton
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout
from v4serve.engine.model.v4.tiny import TINY_CONFIG
from v4serve.kernels.attention import RaggedBatch
from v4serve.kernels.paged import (
    read_entries,
    read_entries_batched,
    ring_read,
    ring_read_batched,
    ring_write,
    ring_write_batched,
    write_entries,
    write_entries_batched,
)
from v4serve.kernels.registry import load_kernels


def test_ring_keeps_the_last_rows_at_position_mod_length() -> None:
    ring = torch.zeros(8, 2)
    rows = torch.arange(11 * 2, dtype=torch.float32).view(11, 2)  # positions 5..15
    ring_write(ring, 16, rows)
    positions = torch.arange(8, 16)
    assert torch.equal(ring_read(ring, positions), rows[-8:])
    assert torch.equal(ring[positions % 8], rows[-8:])
    ring_write(ring, 17, rows[:1])  # position 16 overwrites position 8's row
    assert torch.equal(ring_read(ring, torch.tensor([16])), rows[:1])
    assert torch.equal(ring_read(ring, torch.arange(9, 16)), rows[-7:])


def test_batched_ring_access_matches_one_by_one() -> None:
    rings = torch.zeros(3, 4, 2)
    slots, positions = torch.tensor([2, 0]), torch.tensor([5, 9])
    ring_write_batched(rings, slots, positions, torch.tensor([[1.0, 1.0], [2.0, 2.0]]))
    assert rings[2, 1].tolist() == [1.0, 1.0] and rings[0, 1].tolist() == [2.0, 2.0]
    window = torch.tensor([[3, 4, 5], [7, 8, 9]])
    got = ring_read_batched(rings, slots, window)
    assert torch.equal(got[0], ring_read(rings[2], window[0])) and torch.equal(got[1], ring_read(rings[0], window[1]))


def test_entries_through_block_tables_equal_the_flat_sequence() -> None:
    cache = torch.zeros(10, 4, 3)  # 10 blocks of 4 entries
    tables = [[7, 2, 5], [0, 9]]
    flat = [torch.randn(11, 3), torch.randn(6, 3)]
    for table, entries in zip(tables, flat, strict=True):
        write_entries(cache, table, 0, entries[:5])
        write_entries(cache, table, 5, entries[5:])  # a second write crossing a block edge
    for table, entries in zip(tables, flat, strict=True):
        assert torch.equal(read_entries(cache, table, len(entries)), entries)
    batched = read_entries_batched(cache, torch.tensor([[7, 2, 5], [0, 9, 0]]), 6)  # padded block tables
    assert torch.equal(batched[0], flat[0][:6]) and torch.equal(batched[1], flat[1][:6])


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_window_writes_of_a_ragged_batch_match_one_by_one(backend: str) -> None:
    """Decodes and chunks (one longer than the window) in one call, against ring_write per sequence."""
    write = load_kernels(backend).write_window
    gen = torch.Generator().manual_seed(4)
    seqs = [(2, 5, 1), (0, 0, 11), (3, 9, 3), (1, 20, 1)]  # (slot, start, new tokens); window 4
    batch = RaggedBatch.build([s[0] for s in seqs], [s[1] for s in seqs], [s[2] for s in seqs], [0] * 4,
                              [[0]] * 4, "cpu")
    kv = torch.randn(batch.num_rows, 3, generator=gen)
    ring = torch.randn(4, 4, 3, generator=gen)
    want = ring.clone()
    for (slot, start, n), offset in zip(seqs, batch.offsets, strict=True):
        ring_write(want[slot], start + n, kv[offset:offset + n])
    write(ring, kv, batch)
    assert torch.equal(ring, want)


def test_one_entry_per_sequence_lands_where_the_block_table_says() -> None:
    cache = torch.zeros(10, 4, 3)
    tables = torch.tensor([[7, 2, 5], [0, 9, 0]])  # padded block tables
    rows = torch.randn(2, 3)
    write_entries_batched(cache, tables, torch.tensor([9, 4]), rows)  # entry 9 → block 5 row 1; 4 → block 9 row 0
    assert torch.equal(cache[5, 1], rows[0]) and torch.equal(cache[9, 0], rows[1])
    assert int((cache != 0).any(-1).sum()) == 2


def test_device_tensors_have_the_layouts_byte_sizes() -> None:
    layout = KVLayout.from_config(TINY_CONFIG)
    kv = DeviceKV(layout, num_slots=3, num_blocks=5, dtype=torch.float16)
    slot_bytes = sum(t[0].numel() * t.element_size() for layer in kv.layers for t in layer.slot_tensors())
    block_bytes = sum(t[0].numel() * t.element_size() for layer in kv.layers for t in layer.block_tensors())
    assert slot_bytes == layout.state_bytes_per_slot(2) == kv.slot_nbytes()
    assert block_bytes == layout.block_bytes(2)
    assert sum(len(p) for p in kv.block_payload(0)) == block_bytes  # every part's bytes, in one buffer


def test_a_block_payload_keeps_the_bytes_of_when_it_was_taken() -> None:
    """The SSD store's writer reads a sealed block's payload later; the block may be reused before."""
    kv = DeviceKV(KVLayout.from_config(TINY_CONFIG), num_slots=2, num_blocks=3, dtype=torch.float16)
    parts = [t for layer in kv.layers for t in layer.block_tensors()]
    for i, t in enumerate(parts):
        t[1].fill_(i + 1)
    payload = kv.block_payload(1)
    for t in parts:
        t[1].fill_(-7)  # reused and rewritten before the writer reads
    assert b"".join(payload) == b"".join(torch.full_like(t[1], i + 1).view(torch.uint8).numpy().tobytes()
                                         for i, t in enumerate(parts))


def test_slot_tables_hold_each_slots_padded_table_and_send_only_what_changed() -> None:
    from v4serve.kernels import attention

    tables = attention.SlotTables(num_slots=3, max_blocks=6, device="cpu")
    sent: list[int] = []
    upload = attention.upload
    attention.upload = lambda values, device, **kw: (sent.append(len(values)), upload(values, device, **kw))[1]
    try:
        a, b = [4, 9], [7]
        tables.update([0, 2], [a, b])
        assert sent == [6]  # three entries: their places and values
        tables.update([0, 2], [a, b])
        assert sent == [6]  # nothing changed, nothing sent
        a.extend([11, 12])  # a request's table grows
        tables.update([2, 0], [b, a])
        assert sent == [6, 4]
        c = [3]  # another request in slot 0: its table, the rest of the row zeroed
        tables.update([0], [c])
        assert sent == [6, 4, 8]
    finally:
        attention.upload = upload
    assert tables.rows.tolist() == [[3, 0, 0, 0, 0, 0], [0] * 6, [7, 0, 0, 0, 0, 0]]
    batch = attention.RaggedBatch.build([2, 0], [5, 1], [1, 1], [0, 0], [b, c], "cpu", slot_tables=tables)
    assert torch.equal(batch.tables, torch.tensor([[7], [3]]))
    with pytest.raises(ValueError, match="7 blocks does not fit 6"):
        tables.update([1], [list(range(7))])
