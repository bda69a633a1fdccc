"""DeepSeek-V4.1's text model (engine/model/v41/): a prompt computed whole, in chunks and one token at
a time gives the same logits (the state each step leaves is what the next one needs), at a window and
block boundary and off by one each side. The independent oracle comparison (nemo-automodel) follows.

Here the KV rounding (FP8/FP4) is switched off: a row's projection differs in its last bits with the
number of rows computed beside it, and a last-bit difference can cross a rounding boundary, so with
rounding on the equality needs row-invariant projections (the next step); what this checks is that the
window rings, the open pooling groups, the entries and the picks carry over exactly."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import v41_rounding_off
from v4serve.engine.model.config import YarnScaling
from v4serve.engine.model.v41.config import V41Config
from v4serve.engine.model.v41.model import DeepseekV41

CFG = V41Config(
    vocab_size=300, hidden_size=64, num_layers=8, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=32, o_groups=2,
    o_lora_rank=16, window=128, compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1), kv_source_layers=(1, 3, 4),
    index_source_layers=(1, 2, 3, 4, 6), index_n_heads=2, index_head_dim=32, index_topk=16, candidate_layer=4,
    candidate_topk_blocks=3, candidate_block_size=8, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
    moe_intermediate_size=32, routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0, hc_mult=4,
    hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-20, rope_theta=10000.0, compress_rope_theta=160000.0,
    yarn=YarnScaling(), engram_layers=(1, 5), engram_num_embeddings=(700, 700), engram_max_ngram=3,
    engram_vocab_size=100, engram_n_heads=2, engram_head_dim=16)


def random_model() -> DeepseekV41:
    """CFG with random weights (seeded), scaled so that activations stay O(1)."""
    torch.manual_seed(0)
    m = DeepseekV41(CFG, token_map=list(range(CFG.vocab_size)))
    with torch.no_grad():
        for name, p in m.named_parameters():
            if not any(s in name for s in ("norm", "scale", "q_weight", "k_weight")):
                p.normal_(0, 0.1 if p.dim() > 1 else 0.02)
    return m


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    return random_model()


def _run(model: DeepseekV41, ids: torch.Tensor, chunk: int) -> torch.Tensor:
    kv, back, parts = model.new_sequence(), CFG.engram_max_ngram - 1, []
    for a in range(0, len(ids), chunk):
        z = min(a + chunk, len(ids))
        parts.append(model.run_sequence(ids[max(0, a - back):z], z - a, kv))
    assert kv.length == len(ids)
    return torch.cat(parts)


@pytest.mark.parametrize("chunk", [1, 37, 127, 128, 129])
def test_chunks_and_decodes_equal_the_whole_prompt(model: DeepseekV41, chunk: int,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    v41_rounding_off(monkeypatch)
    ids = torch.randint(0, CFG.vocab_size, (300,), generator=torch.Generator().manual_seed(1))
    whole = _run(model, ids, len(ids))
    assert whole.abs().max() > 0.5  # not a degenerate model
    torch.testing.assert_close(_run(model, ids, chunk), whole, rtol=1e-4, atol=1e-4)
