"""The embedded `tiny` model: every layer kind, the real window (128) and ratios (4 and 128), so
blocks are 128 tokens like the real checkpoints; deterministic weights from a seed."""

from __future__ import annotations

import dataclasses

import torch

from v4serve.engine.model.config import ModelConfig, YarnScaling
from v4serve.engine.model.v4.model import DeepseekV4

TINY_CONFIG = ModelConfig(
    vocab_size=320,  # the byte tokenizer: 64 specials + 256 bytes
    hidden_size=128,
    num_layers=4,
    num_heads=4,
    head_dim=64,
    rope_dim=16,
    q_lora_rank=64,
    o_groups=2,
    o_lora_rank=64,
    window=128,
    compress_ratios=(0, 4, 128, 4),
    csa_ratio=4,
    index_n_heads=8,
    index_head_dim=32,
    index_topk=16,
    n_routed_experts=8,
    n_shared_experts=1,
    num_experts_per_tok=2,
    moe_intermediate_size=64,
    routed_scaling_factor=1.5,
    scoring_func="sqrtsoftplus",
    num_hash_layers=1,
    swiglu_limit=10.0,
    hc_mult=4,
    hc_sinkhorn_iters=20,
    hc_eps=1e-6,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    compress_rope_theta=160000.0,
    yarn=YarnScaling(),
    max_position_embeddings=1048576,
)


def tiny_config(**overrides: object) -> ModelConfig:
    """The tiny config, or a sized variant of it."""
    return dataclasses.replace(TINY_CONFIG, **overrides)


@torch.no_grad()
def init_weights(model: DeepseekV4, seed: int = 0) -> DeepseekV4:
    """Deterministic random weights with scales that keep activations O(1) and logits spread out
    (so greedy choices are decided by clear margins, not by rounding)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.cfg
    # By checkpoint name (the MoE stacks its experts' weights under other names), so the weights
    # do not depend on how the model lays them out.
    buffers = dict(model.named_buffers())
    params = sorted((name, t) for name, t in model.state_dict().items() if name not in buffers)
    # Multi-token-prediction layers last: the main weights are the same with them or without.
    main = [(name, t) for name, t in params if not name.startswith("mtp.")]
    model.load_state_dict({name: init_tensor(name, t, gen) for name, t in main}, strict=False)
    for name, buf in sorted(buffers.items()):
        if name.endswith("tid2eid"):
            scores = torch.rand(cfg.vocab_size, cfg.n_routed_experts, generator=gen)
            buf.copy_(scores.topk(cfg.num_experts_per_tok, dim=-1).indices)
    mtp = [(name, t) for name, t in params if name.startswith("mtp.")]
    model.load_state_dict({name: init_tensor(name, t, gen) for name, t in mtp}, strict=False)
    return model


def init_tensor(name: str, param: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """A random value for one tensor, by its checkpoint name (both families name alike)."""
    def normal(std: float) -> torch.Tensor:
        return torch.randn(param.shape, generator=gen) * std

    leaf = name.rsplit(".", 1)[-1]
    if name.endswith("norm.weight"):
        return 1.0 + normal(0.1)
    if leaf in ("attn_sink", "bias", "ape") or leaf.endswith("_base"):
        return normal(0.5)
    if leaf.endswith("_scale"):
        return 1.0 + normal(0.2)
    if leaf.endswith("_fn"):
        return normal(param.shape[1] ** -0.5)
    if name == "embed.weight":
        return normal(1.0)
    if name == "head.weight":
        return normal(3.0 * param.shape[1] ** -0.5)
    return normal(param.shape[-1] ** -0.5)


def build_tiny(cfg: ModelConfig | None = None, seed: int = 0) -> DeepseekV4:
    """The tiny model (or a sized variant) with random weights, its config's multi-token-prediction
    layers included (`num_nextn_predict_layers`)."""
    cfg = cfg or TINY_CONFIG
    return init_weights(DeepseekV4(cfg, mtp_layers=cfg.num_nextn_predict_layers), seed).eval()
