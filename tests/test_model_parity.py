"""v4serve's DeepSeek-V4 against transformers' DeepseekV4ForCausalLM on the same checkpoint.

Each layout is written as a real checkpoint folder with the official tensor names, loaded by
transformers (its own name conversion) and by v4serve's loader; logits must agree to 1e-4
relative for full prefill, chunked prefill and token-by-token decode.
"""

from __future__ import annotations

import copy
import functools
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
import transformers  # the numerical oracle (test-only dependency)

from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint
from v4serve.kernels.registry import load_kernels

# Small dims keep transformers' eager forward quick; 16 indexer heads and a top-k well below
# the number of visible entries make the indexer's choice matter without score ties.
SMALL = dict(hidden_size=64, num_heads=4, head_dim=32, rope_dim=8, q_lora_rank=32, o_groups=2,
             o_lora_rank=32, index_n_heads=16, index_head_dim=16, index_topk=6,
             moe_intermediate_size=32, n_routed_experts=6, num_experts_per_tok=2)

LAYOUTS = {
    # DeepSeek-V4-Flash pattern: two window-only layers, CSA/HCA alternating, a window-only tail.
    "flash": (dict(SMALL, num_layers=6, compress_ratios=(0, 0, 4, 128, 4, 0), window=128,
                   num_hash_layers=3), 300, False),
    # DeepSeek-V4-Pro pattern: two HCA layers first.
    "pro": (dict(SMALL, num_layers=5, compress_ratios=(128, 128, 4, 128, 4), window=128,
                 num_hash_layers=2), 300, False),
    # Small window and ratios so a short prompt crosses many window, entry and block edges.
    "small": (dict(SMALL, num_layers=5, compress_ratios=(0, 4, 16, 4, 16), window=8,
                   num_hash_layers=1), 120, True),
}


def rel_err(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return ((ours - ref).abs().max() / ref.abs().max()).item()


# Chunk sizes on and off the window, entry and block edges of each layout.
CHUNKS = {"flash": [1, 5, 64, 127, 128, 129], "pro": [1, 4, 100, 127, 128, 129],
          "small": [1, 3, 4, 5, 7, 8, 9, 15, 16, 17]}


@functools.cache
def make_case(name: str) -> tuple[DeepseekV4, list[int], torch.Tensor]:
    overrides, length, hf_form = LAYOUTS[name]
    cfg = tiny_config(**overrides)
    folder = write_checkpoint(build_tiny(cfg, seed=7), Path(tempfile.mkdtemp(prefix=f"parity-{name}-")),
                              transformers_config=hf_form)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, cfg.vocab_size, (length,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(ids[None]).logits[0]
    model = load_model(folder, progress=False)
    shutil.rmtree(folder)
    return model, ids.tolist(), ref


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_full_prefill(name):
    model, ids, ref = make_case(name)
    ours = SingleSequence(model, len(ids)).prefill(ids)
    assert rel_err(ours, ref) <= 1e-4


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_prefill_then_decode(name):
    model, ids, ref = make_case(name)
    seq = SingleSequence(model, len(ids))
    split = len(ids) // 3
    parts = [seq.prefill(ids[:split])] + [seq.step([t]) for t in ids[split:]]
    assert rel_err(torch.cat(parts), ref) <= 1e-4


@pytest.mark.parametrize(("name", "chunk"), [(n, c) for n in sorted(CHUNKS) for c in CHUNKS[n]])
def test_chunked_prefill(name, chunk):
    model, ids, ref = make_case(name)
    if chunk == 1:
        ids, ref = ids[:150], ref[:150]  # causal: a prefix's logits are the prefix of the logits
    ours = SingleSequence(model, len(ids)).prefill(ids, chunk=chunk)
    assert rel_err(ours, ref) <= 1e-4


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_oracle_detects_a_wrong_indexer(name):
    """The comparison is sharp enough to see a changed top-k: if it were not, the parity
    tests above could not catch an indexer bug."""
    model, ids, ref = make_case(name)
    assert model.cfg.index_topk < len(ids) // model.cfg.csa_ratio, "top-k must leave entries out"
    indexers = [blk.attn.indexer for blk in model.layers if blk.attn.indexer is not None]
    saved = [ix.topk for ix in indexers]
    try:
        for ix in indexers:
            ix.topk = saved[0] * 4
        ours = SingleSequence(model, len(ids)).prefill(ids)
    finally:
        for ix, k in zip(indexers, saved, strict=True):
            ix.topk = k
    assert rel_err(ours, ref) > 1e-3


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_fused_projections_match_the_oracle_without_copying_weights(name):
    """`use_kernels` runs the projections that share an input as one GEMM over their stacked
    weights: the same logits, the same state dict, and each weight a view of its stack."""
    model, ids, ref = make_case(name)
    fused = copy.deepcopy(model)
    fused.use_kernels(load_kernels("torch"))
    seq = SingleSequence(fused, len(ids))
    split = len(ids) // 3
    parts = [seq.prefill(ids[:split])] + [seq.step([t]) for t in ids[split:]]
    assert rel_err(torch.cat(parts), ref) <= 1e-4
    want, got = model.state_dict(), fused.state_dict()
    assert list(got) == list(want) and all(torch.equal(got[k], want[k]) for k in want)
    for block in fused.layers:
        for shared in (block.attn.x_inputs, block.attn.qr_inputs):
            # Dense weights of one input width form one stack.
            assert len(shared.stacks) == (len(shared.layers) > 1)
            for stack in shared.stacks:
                assert stack.layers == shared.layers
                for layer in stack.layers:
                    assert layer.weight.untyped_storage().data_ptr() == stack.weight.untyped_storage().data_ptr()
    # Moved after fusing, the weights are new tensors: the next forward stacks them again.
    moved = fused.double().float()
    again = SingleSequence(moved, len(ids))
    assert torch.equal(torch.cat([again.prefill(ids[:split])] + [again.step([t]) for t in ids[split:]]),
                       torch.cat(parts))
    shared = moved.layers[0].attn.x_inputs
    assert shared.layers[0].weight.data_ptr() == shared.stacks[0].weight.data_ptr()
