"""DeepSeek-V4.1's KV in the State and Block Cache (cache/layout.py kind `csa2`, engine/model/v41/paged.py):
the layout's exact shapes, and the model run through slots and block tables equal to the same model on
private dense KV: chunked at the window ±1, two sequences in one step, and after a prefix hit whose
window is recomputed while the hit's entries are read from the blocks and never written."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import v41_rounding_off
from tests.test_v41_model import CFG, random_model
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v41.model import Block, DeepseekV41
from v4serve.engine.model.v41.paged import gather

BACK = CFG.engram_max_ngram - 1


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    return random_model()


def _ids(seed: int, n: int = 300) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def _kv() -> DeviceKV:
    return DeviceKV(KVLayout.from_config(CFG), num_slots=3, num_blocks=12)


def _chunk(ids: torch.Tensor, slot: int, table: list[int], start: int, end: int, **kw: int) -> SeqChunk:
    return SeqChunk(slot=slot, block_table=table, start=start, num_new=end - start,
                    history=tuple(ids[max(0, start - BACK):start].tolist()), **kw)


def _step(model: DeepseekV41, kv: DeviceKV, parts: list[tuple[torch.Tensor, SeqChunk]]) -> list[torch.Tensor]:
    """One engine step over the chunks → each chunk's logits, every row."""
    seqs = [seq for _, seq in parts]
    meta = AttentionMetadata.build(seqs, [range(seq.num_new) for seq in seqs])
    input_ids = torch.cat([ids[seq.start:seq.end] for ids, seq in parts])
    logits = model(input_ids, meta, kv)
    return list(logits.split([seq.num_new for seq in seqs]))


def test_the_layout_holds_a_window_per_layer_and_entries_per_source() -> None:
    layout = KVLayout.from_config(CFG)
    assert layout.block_size == 128
    kinds = [(layer.kind, layer.ratio) for layer in layout.layers]
    # Sources 1 (ratio 2), 3 (ratio 2), 4 (ratio 1); layer 2 reuses 1's entries, 5-7 read 4's.
    assert kinds == [("swa", 0), ("csa2", 2), ("swa", 0), ("csa2", 2), ("csa2", 1), ("swa", 0), ("swa", 0), ("swa", 0)]
    assert layout.layers[0].slot_shapes() == {"window": (128, 64)} and layout.layers[0].block_shapes() == {}
    assert layout.layers[2].slot_shapes() == {"window": (128, 64)} and layout.layers[2].block_shapes() == {}
    assert layout.layers[1].slot_shapes() == {"window": (128, 64), "pending_kv": (2, 64), "pending_score": (2, 64)}
    assert layout.layers[1].block_shapes() == {"entries": (64, 64), "index_keys": (64, 32)}
    assert layout.layers[4].slot_shapes() == {"window": (128, 64)}
    assert layout.layers[4].block_shapes() == {"entries": (128, 64), "index_keys": (128, 32)}
    # Per token: (64 + 32) channels for each ratio-2 source per 2 tokens, and for the ratio-1 one per token.
    assert layout.block_bytes(4) == 4 * (2 * 64 * (64 + 32) + 128 * (64 + 32))


@pytest.mark.parametrize("chunk", [1, 37, 127, 128, 129])
def test_chunks_through_the_cache_equal_dense_kv(model: DeepseekV41, chunk: int) -> None:
    ids, kv, table = _ids(1), _kv(), [7, 2, 5]
    parts = [_step(model, kv, [(ids, _chunk(ids, 1, table, a, min(a + chunk, len(ids))))])[0]
             for a in range(0, len(ids), chunk)]
    # The same operations on the same rows: bitwise, with V4.1's KV rounding on.
    assert torch.equal(torch.cat(parts), _ranked(model, ids, chunk))


def _ranked(model: DeepseekV41, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    view, parts = model.new_sequence(), []
    for a in range(0, len(ids), chunk):
        z = min(a + chunk, len(ids))
        parts.append(model.run_sequence(ids[max(0, a - BACK):z], z - a, view))
    return torch.cat(parts)


def test_two_sequences_in_one_step_keep_to_their_own_slots_and_blocks(model: DeepseekV41) -> None:
    a, b, kv = _ids(2, 200), _ids(3, 200), _kv()
    out_a, out_b = [], []
    for start, end in ((0, 150), (150, 151), (151, 200)):
        got = _step(model, kv, [(a, _chunk(a, 0, [3, 4], start, end)), (b, _chunk(b, 2, [9, 1], start, end))])
        out_a.append(got[0])
        out_b.append(got[1])
    for ids, out in ((a, out_a), (b, out_b)):
        view, expect = model.new_sequence(), []
        for start, end in ((0, 150), (150, 151), (151, 200)):
            expect.append(model.run_sequence(ids[max(0, start - BACK):end], end - start, view))
        # The head runs over both sequences' rows at once: fp32 noise apart from a run on its own.
        torch.testing.assert_close(torch.cat(out), torch.cat(expect), rtol=1e-5, atol=1e-5)


def test_a_prefix_hit_reads_its_entries_and_recomputes_its_window(model: DeepseekV41,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    # Rounding off: the recomputed window rows come from a chunk of another size than the first run's,
    # so they match in all but their last bits (see test_v41_model).
    v41_rounding_off(monkeypatch)
    # The hit: 9 blocks. From nothing, a state is exact again (W − 1) · L tokens on (the zero mode's
    # span: each layer's window reaches W − 1 further back), so those are recomputed into a fresh slot.
    hit, span = 9 * 128, (CFG.window - 1) * CFG.num_layers
    shared = _ids(4, hit)
    first, second = torch.cat([shared, _ids(5, 48)]), torch.cat([shared, _ids(6, 60)])
    kv = DeviceKV(KVLayout.from_config(CFG), num_slots=3, num_blocks=24)
    table = [20, 3, 11, 5, 8, 1, 17, 2, 14]
    _step(model, kv, [(first, _chunk(first, 0, [*table, 6], 0, len(first)))])
    held = {i: [t[table].clone() for t in layer.block_tensors()] for i, layer in enumerate(kv.layers)}
    start = hit - span
    got = _step(model, kv, [(second, _chunk(second, 1, [*table, 9], start, len(second), frozen_until=hit,
                                           window_from=start))])[0]
    cold = model.run_sequence(second, len(second), model.new_sequence())
    torch.testing.assert_close(got[hit - start:], cold[hit:], rtol=1e-5, atol=1e-5)
    for i, layer in enumerate(kv.layers):  # the hit's blocks are read, never written
        for before, now in zip(held[i], layer.block_tensors(), strict=True):
            assert torch.equal(before, now[table])
    # What the second sequence's own block holds is what a cold run of it computes.
    view = model.new_sequence()
    model.run_sequence(second, len(second), view)
    mine = gather(CFG, kv, SeqChunk(slot=1, block_table=[*table, 9], start=len(second), num_new=0))
    for layer in CFG.kv_source_layers:
        torch.testing.assert_close(mine.sources[layer].entries, view.sources[layer].entries, rtol=1e-5, atol=1e-5)


def test_the_layers_past_the_last_source_run_on_the_tail_of_a_long_prefill(model: DeepseekV41,
                                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers 5-7 own no entries: a prefill chunk runs them on the rows that reach its wanted rows or the next
    step's windows (W − 1 fewer at each layer up), after a chunk that did the same, and what follows is the
    full computation's."""
    v41_rounding_off(monkeypatch)  # fewer rows: last bits differ, as between chunkings
    computed: list[int] = []
    forward = Block.forward

    def counting(block: Block, h: torch.Tensor, *args: object) -> object:
        computed.append(h.shape[0])
        return forward(block, h, *args)

    ids, kv, table = _ids(7, 1003), _kv(), [4, 10, 0, 6, 2, 8, 11, 1]
    monkeypatch.setattr(Block, "forward", counting)
    first = _chunk(ids, 0, table, 0, 500)
    model(ids[:500], AttentionMetadata.build([first], [[]]), kv)  # a chunk whose logits no one wants
    got = [model(ids[500:1000], AttentionMetadata.build([_chunk(ids, 0, table, 500, 1000)]), kv)]
    # Each chunk: 373 = min(wanted, 500 − 127) rows, less 127 per layer above, skipped by layers 6 and 7.
    assert computed == 2 * ([500] * 6 + [500 - 119, 500 - 246])
    for at in range(1000, 1003):
        got.append(model(ids[at:at + 1], AttentionMetadata.build([_chunk(ids, 0, table, at, at + 1)]), kv))
    monkeypatch.setattr(Block, "forward", forward)
    cold = model.run_sequence(ids, len(ids), model.new_sequence())
    torch.testing.assert_close(torch.cat(got), cold[999:1003], rtol=1e-5, atol=1e-5)
