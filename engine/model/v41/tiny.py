"""The embedded `tiny-v41` model: DeepSeek-V4.1's every layer kind at a tiny width (window-only,
Engram, ratio-2 KV source and reuse, ratio-1 source with the candidate stage, re-index), the real
window (128, so 128-token blocks) and the embedded byte tokenizer's vocabulary; weights from a seed."""

from __future__ import annotations

import dataclasses

import torch

from v4serve.engine.model.config import YarnScaling
from v4serve.engine.model.v4.tiny import init_tensor
from v4serve.engine.model.v41.config import V41Config
from v4serve.engine.model.v41.model import DeepseekV41

TINY_V41_CONFIG = V41Config(
    vocab_size=320,  # the byte tokenizer: 64 specials + 256 bytes
    hidden_size=128, num_layers=8, num_heads=4, head_dim=64, rope_dim=16, q_lora_rank=64, o_groups=2,
    o_lora_rank=64, window=128,
    compress_ratios=(0, 0, 2, 2, 2, 1, 1, 1), kv_source_layers=(2, 4, 5), index_source_layers=(2, 4, 5, 6),
    index_n_heads=8, index_head_dim=32, index_topk=16,
    candidate_layer=5, candidate_topk_blocks=8, candidate_block_size=8,
    n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, moe_intermediate_size=64,
    routed_scaling_factor=1.5, scoring_func="sqrtsoftplus", swiglu_limit=10.0,
    hc_mult=4, hc_sinkhorn_iters=20, hc_eps=1e-6, rms_norm_eps=1e-20,
    rope_theta=10000.0, compress_rope_theta=160000.0, yarn=YarnScaling(),
    engram_layers=(1, 4), engram_num_embeddings=(3000, 3000), engram_max_ngram=3, engram_vocab_size=256,
    engram_n_heads=4, engram_head_dim=32, engram_pad_token_id=2,
    image_token_id=16,  # the byte tokenizer's <｜image｜>
    engram_compressed_vocab_size=291,  # the byte tokenizer's ids folded as the Engram folds them
)


def tiny_v41_config(**overrides: object) -> V41Config:
    return dataclasses.replace(TINY_V41_CONFIG, **overrides)


@torch.no_grad()
def build_tiny_v41(token_map: list[int], cfg: V41Config | None = None, seed: int = 0) -> DeepseekV41:
    """`token_map`: the embedded byte tokenizer's Engram map (`server.text.engram_map.folded_vocabulary` of
    its vocabulary), which the front end builds: text is not the engine's."""
    cfg = cfg or TINY_V41_CONFIG
    model = DeepseekV41(cfg, token_map)
    gen = torch.Generator().manual_seed(seed)
    state = sorted(model.state_dict().items())
    model.load_state_dict({name: _init(name, t, gen) for name, t in state})
    return model.eval()


def _init(name: str, param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    if name.endswith(("q_weight", "k_weight")):  # the Engram's gate norms
        return 1.0 + torch.randn(param.shape, generator=gen) * 0.1
    return init_tensor(name, param, gen)
