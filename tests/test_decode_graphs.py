"""The decode step CUDA graphs replay, run here from the same static buffers without capture: for
batches of different sizes in one bucket, at contexts below, on and past block and top-k edges, one
step after another, it gives the eager step's logits and writes its KV (within fp32 noise: the
padding rows change the dense GEMMs' row count, so their CPU blocking; same greedy tokens), touching
nothing but the scratch slot and block besides. Whatever a replay would freeze (the Python side of
the forward, shapes, host values) is frozen here too, so a forward that depended on it differs:
the --batch-invariant torch kernels, driven row by row from the host, do (graphs stay off there)."""

from __future__ import annotations

import copy

import pytest
import torch

from tests.daemon import daemon
from tests.helpers import SMALL, SMALL_ONE_OF_EACH, engine_for
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout
from v4serve.engine.model.gpu.decode_graphs import DecodeGraphs, decode_buckets
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.kernels.attention import SlotTables
from v4serve.kernels.registry import load_kernels

MAX_LEN = 256
CONTEXTS = (9, 23, 24, 25, 70, 130)  # top-k 6 of ratio-4 entries: (p + 1) // 4 against 6 at p = 23


def test_buckets() -> None:
    assert decode_buckets(1) == (1,)
    assert decode_buckets(16) == (1, 2, 4, 8, 16)
    assert decode_buckets(20) == (1, 2, 4, 8, 16, 20)
    assert decode_buckets(3) == (1, 2, 3)


def setup(backend: str, batch_invariant: bool = False) -> tuple[object, DeviceKV, list[list[int]], int]:
    model = build_tiny(tiny_config(**SMALL_ONE_OF_EACH), seed=11)
    cfg = model.cfg
    width = -(-MAX_LEN // cfg.block_size)
    n = len(CONTEXTS)
    # The engine's arrangement: the pools' slots and blocks, then one scratch slot and block.
    kv = DeviceKV(KVLayout.from_config(cfg), num_slots=n + 1, num_blocks=n * width + 1)
    tables = [list(range(i * width, i * width + -(-(c + 1) // cfg.block_size))) for i, c in enumerate(CONTEXTS)]
    gen = torch.Generator().manual_seed(4)
    model.use_kernels(load_kernels("torch"))
    for i, c in enumerate(CONTEXTS):
        prompt = torch.randint(0, cfg.vocab_size, (c,), generator=gen)
        model(prompt, AttentionMetadata.build([SeqChunk(slot=i, block_table=tables[i], start=0, num_new=c)]), kv)
    model.use_kernels(load_kernels(backend, batch_invariant=batch_invariant))
    return model, kv, tables, width


def without_scratch(kv: DeviceKV) -> list[torch.Tensor]:
    out = []
    for layer in kv.layers:
        for name, t in vars(layer).items():
            if isinstance(t, torch.Tensor):
                lead = kv.num_slots if t.shape[0] == kv.num_slots else kv.num_blocks
                out.append((name, t[:lead - 1]))
    return out


def static_vs_eager(backend: str, batch_invariant: bool = False,
                    slot_tables: bool = False) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Five steps one after another (bucket 4 with 3 and 4 rows, bucket 8 with 6, bucket 1, bucket 4),
    each row decoding where it stands, through the static step and eagerly: their logits, and each
    step's KV (all but the scratch slot and block) compared as it goes. With `slot_tables` the static
    step gathers its tables from the slots' rows on the device, as the engine's does."""
    model, kv, tables, width = setup(backend, batch_invariant)
    eager_kv, static_kv = copy.deepcopy(kv), copy.deepcopy(kv)
    rows_on_device = SlotTables(kv.num_slots, width, kv.device) if slot_tables else None
    graphs = DecodeGraphs(model, static_kv, (1, 2, 4, 8), width, scratch_slot=len(CONTEXTS),
                          scratch_block=kv.num_blocks - 1, capture=False, slot_tables=rows_on_device)
    positions = list(CONTEXTS)
    gen = torch.Generator().manual_seed(5)
    out = []
    for rows in ([0, 2, 4], [1, 3, 4, 5], [0, 1, 2, 3, 4, 5], [5], [2, 3, 5]):
        seqs = [SeqChunk(slot=i, block_table=tables[i], start=positions[i], num_new=1) for i in rows]
        ids = torch.randint(0, model.cfg.vocab_size, (len(rows),), generator=gen).tolist()
        assert graphs.fits(seqs)
        if rows_on_device is not None:
            rows_on_device.update([q.slot for q in seqs], [q.block_table for q in seqs])
        want = model(torch.tensor(ids), AttentionMetadata.build(copy.deepcopy(seqs)), eager_kv)
        out.append((graphs.run(ids, seqs).logits.clone(), want))
        if not batch_invariant:
            for (name, a), (_, b) in zip(without_scratch(static_kv), without_scratch(eager_kv), strict=True):
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=f"{rows} {name}")
        for i in rows:
            positions[i] += 1
            assert len(tables[i]) * model.cfg.block_size > positions[i]  # the tables cover the next step
    return out


@pytest.mark.parametrize(("backend", "slot_tables"), [("torch", False), ("triton", False), ("torch", True)])
def test_the_static_step_is_the_eager_step(backend: str, slot_tables: bool) -> None:
    for got, want in static_vs_eager(backend, slot_tables=slot_tables):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_a_forward_derives_its_step_from_the_batch_tensors_alone() -> None:
    """A replay runs no Python, so what the batch derived before the captured forward (entry counts
    from the warm-up runs, say) would be frozen into the graph: each forward derives it again. Here
    a batch holds another step's derived values (8 positions back) and still computes its own step."""
    model, kv, tables, _ = setup("torch")
    ids = torch.arange(1, len(CONTEXTS) + 1)

    def step(back: int) -> tuple[AttentionMetadata, object]:
        meta = AttentionMetadata.build([SeqChunk(slot=i, block_table=tables[i], start=c - back, num_new=1)
                                        for i, c in enumerate(CONTEXTS)])
        return meta, meta.ragged(kv.device)

    meta, batch = step(0)
    want = model(ids, meta, copy.deepcopy(kv), batch=batch)
    other_meta, other = step(8)
    model(ids, other_meta, copy.deepcopy(kv), batch=other)
    assert other._memo, "the forward derived nothing: this test no longer tests anything"
    meta, batch = step(0)
    batch._memo.update(other._memo)
    assert torch.equal(model(ids, meta, copy.deepcopy(kv), batch=batch), want)


def test_a_forward_driven_from_the_host_is_caught() -> None:
    """The --batch-invariant torch kernels loop over the batch's Python tuples: frozen at the bucket's
    scratch rows, their step is not the eager step (why the engine captures no graphs with them)."""
    worst = max((got - want).abs().max().item() for got, want in static_vs_eager("torch", batch_invariant=True))
    assert worst > 0.1


def test_the_bucket_alone_is_not_the_step() -> None:
    """The comparison above can fail: the bucket's template (scratch rows, no refill) is not the step."""
    model, kv, tables, width = setup("torch")
    graphs = DecodeGraphs(model, copy.deepcopy(kv), (4,), width, scratch_slot=len(CONTEXTS),
                          scratch_block=kv.num_blocks - 1, capture=False)
    seqs = [SeqChunk(slot=i, block_table=tables[i], start=CONTEXTS[i], num_new=1) for i in range(4)]
    want = model(torch.tensor([1, 2, 3, 4]), AttentionMetadata.build(copy.deepcopy(seqs)), copy.deepcopy(kv))
    assert not torch.equal(graphs._forward(graphs.buckets[(4, 1)])[0][:4], want)
    assert torch.equal(graphs.run([1, 2, 3, 4], seqs).logits, want)


def test_what_does_not_fit_runs_eagerly() -> None:
    model, kv, tables, width = setup("torch")
    graphs = DecodeGraphs(model, kv, (1, 2), width, scratch_slot=len(CONTEXTS), scratch_block=kv.num_blocks - 1,
                          capture=False)
    decode = [SeqChunk(slot=i, block_table=tables[i], start=CONTEXTS[i], num_new=1) for i in range(2)]
    assert graphs.fits(decode)
    assert not graphs.fits(decode + decode[:1])  # past the largest bucket
    assert not graphs.fits([SeqChunk(slot=0, block_table=tables[0], start=CONTEXTS[0], num_new=3)])  # a chunk
    assert not graphs.fits([SeqChunk(slot=0, block_table=list(range(width + 1)), start=0, num_new=1)])


def test_version_says_whether_graphs_run_and_why_not() -> None:
    import httpx

    with daemon("--enforce-eager") as url:
        assert httpx.get(url + "/version").json()["cuda_graphs"] == "off (--enforce-eager)"
    engine = engine_for(build_tiny(tiny_config(**SMALL), seed=11))
    assert engine.cuda_graphs == "off (not on CUDA: cpu)" and engine.graphs is None


def test_graphs_are_captured_only_where_a_step_is_free_of_host_values() -> None:
    from v4serve.engine.engine import EngineConfig, _cuda_graphs
    from v4serve.engine.speculative import SpeculativeConfig

    cuda = torch.device("cuda")  # a name: nothing runs on it here
    model = build_tiny(tiny_config(**SMALL), seed=11)
    model.use_kernels(load_kernels("triton"))
    assert _cuda_graphs(cuda, EngineConfig(), model, None) == "on"
    assert _cuda_graphs(cuda, EngineConfig(enforce_eager=True), model, None) == "off (--enforce-eager)"
    assert _cuda_graphs(cuda, EngineConfig(), model, ranks=object()) == "on"  # every rank captures alike
    mtp = EngineConfig(speculative=SpeculativeConfig("mtp", 2))  # drafted passes and the layer's: buckets too
    assert _cuda_graphs(cuda, mtp, model, ranks=object()) == "on"
    model.use_kernels(load_kernels("triton", batch_invariant=True))
    assert _cuda_graphs(cuda, EngineConfig(), model, None).startswith("off (--batch-invariant")
    model.use_kernels(load_kernels("torch"))
    assert _cuda_graphs(cuda, EngineConfig(), model, None).startswith("off (--attention-backend torch")
