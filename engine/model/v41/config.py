"""DeepSeek-V4.1's text configuration: one frozen dataclass, built once from a checkpoint's nested
config.json (`model_type: deepseek_v41`, the text model under `text_config`, the vision tower's under
`vision_config`).

What V4.1 adds to V4's vocabulary, per layer l (0-based):
- `compress_ratios[l]`: 0 = sliding window only, 2 = entries pooled from 2 tokens, 1 = one entry
  per token (a projection);
- `kv_source_layers`: the layers that compute compressed entries (and the indexer's keys); every
  later compressed layer up to the next source reads the last source's entries (a reuse layer);
- `index_source_layers`: the layers that run the indexer's queries and pick the top-k entries;
  the other compressed layers attend to the last pick;
- `candidate_layer`: an index source whose scores keep, per query, the best
  `candidate_topk_blocks` blocks of `candidate_block_size` entries; every later index source
  picks its top-k only among them;
- `engram_layers`: layers that add an n-gram memory lookup to the residual streams before the block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

from v4serve.engine.model.config import YarnScaling

MODEL_TYPE = "deepseek_v41"


@dataclass(frozen=True)
class V41Config:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    head_dim: int
    rope_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    window: int
    compress_ratios: tuple[int, ...]
    kv_source_layers: tuple[int, ...]
    index_source_layers: tuple[int, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    candidate_layer: int  # −1: no candidate stage
    candidate_topk_blocks: int
    candidate_block_size: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    engram_layers: tuple[int, ...] = ()
    engram_num_embeddings: tuple[int, ...] = ()
    engram_max_ngram: int = 4
    engram_vocab_size: int = 16000000
    engram_n_heads: int = 8
    engram_head_dim: int = 256
    engram_pad_token_id: int = 2
    engram_compressed_vocab_size: int = 0
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    image_token_id: int = 129264
    num_nextn_predict_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    # V4.1's MoE has no hash-routed layers (read by the MoE shared with V4).
    num_hash_layers = 0

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} layers")
        if any(r not in (0, 1, 2) for r in self.compress_ratios):
            raise ValueError(f"V4.1 compress ratios are 0, 1 or 2, got {sorted(set(self.compress_ratios))}")
        if self.rope_dim % 2 or self.rope_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"rope dim {self.rope_dim} must be even and fit in every head")
        if self.num_heads % self.o_groups:
            raise ValueError("num_heads must be divisible by o_groups")
        if not set(self.kv_source_layers) <= set(self.index_source_layers):
            raise ValueError("every KV source layer must also be an index source")
        ratio_of_source = 0
        for layer, ratio in enumerate(self.compress_ratios):
            if ratio == 0:
                if layer in self.index_source_layers:
                    raise ValueError(f"window-only layer {layer} cannot be a KV or index source")
                continue
            if layer in self.kv_source_layers:
                ratio_of_source = ratio
            if ratio_of_source != ratio:
                raise ValueError(f"compressed layer {layer} has no earlier KV source of ratio {ratio}")
        if self.candidate_layer >= 0 and self.candidate_layer not in self.kv_source_layers:
            raise ValueError("the candidate stage must run on a KV source layer")
        if len(self.engram_layers) != len(self.engram_num_embeddings):
            raise ValueError("engram_num_embeddings needs one table size per Engram layer")

    # ---- derived facts -------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        return self.compress_ratios[layer]

    def layer_kind(self, layer: int) -> str:
        """What a layer owns in the KV cache: a KV source its entries (`csa2`), any other layer a window
        alone (`swa`), reuse and re-index layers included."""
        return "csa2" if layer in self.kv_source_layers else "swa"

    def source_of(self, layer: int) -> int:
        """The KV source layer whose entries a compressed layer reads (itself for a source)."""
        return max(s for s in self.kv_source_layers if s <= layer)

    def index_source_of(self, layer: int) -> int:
        """The index source whose top-k pick a compressed layer attends to (itself for one)."""
        return max(s for s in self.index_source_layers if s <= layer)

    def uses_candidates(self, layer: int) -> bool:
        return 0 <= self.candidate_layer < layer and layer in self.index_source_layers

    @property
    def block_size(self) -> int:
        """Tokens per Block Cache block: a whole number of windows and of every pooling group."""
        return reduce(math.lcm, [r for r in self.compress_ratios if r], self.window)

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    @property
    def engram_hash_heads(self) -> int:
        """Table lookups per token in an Engram layer: `engram_n_heads` for each n-gram order 2..N."""
        return (self.engram_max_ngram - 1) * self.engram_n_heads

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> V41Config:
        """A nested V4.1 config.json (or its `text_config` alone)."""
        text = dict(raw.get("text_config") or raw)
        for key in ("image_token_id", "bos_token_id", "eos_token_id"):
            if key in raw and key not in text:
                text[key] = raw[key]
        return _parse(text)

    def to_official_dict(self) -> dict[str, Any]:
        """The official nested config.json spelling (text only: `vision_config` has no layers)."""
        text: dict[str, Any] = {
            "model_type": "deepseek_v41_text",
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": 1,
            "head_dim": self.head_dim,
            "qk_rope_head_dim": self.rope_dim,
            "q_lora_rank": self.q_lora_rank,
            "o_groups": self.o_groups,
            "o_lora_rank": self.o_lora_rank,
            "sliding_window": self.window,
            "compress_ratios": list(self.compress_ratios) + [0] * self.num_nextn_predict_layers,
            "kv_source_layer_ids": list(self.kv_source_layers),
            "index_source_layer_ids": list(self.index_source_layers),
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "candidate_source_layer_id": self.candidate_layer,
            "candidate_topk_blocks": self.candidate_topk_blocks,
            "candidate_block_size": self.candidate_block_size,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": self.scoring_func,
            "norm_topk_prob": True,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "engram_layer_ids": list(self.engram_layers),
            "engram_num_embeddings": list(self.engram_num_embeddings),
            "engram_max_ngram_size": self.engram_max_ngram,
            "engram_vocab_size": self.engram_vocab_size,
            "engram_n_heads": self.engram_n_heads,
            "engram_head_dim": self.engram_head_dim,
            "engram_pad_token_id": self.engram_pad_token_id,
            "engram_compressed_vocab_size": self.engram_compressed_vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "dtype": "float32",
        }
        if self.yarn is not None:
            text["rope_scaling"] = {"rope_type": "yarn", "factor": self.yarn.factor,
                                    "original_max_position_embeddings": self.yarn.original_max_position_embeddings,
                                    "beta_fast": self.yarn.beta_fast, "beta_slow": self.yarn.beta_slow}
        return {
            "architectures": ["DeepseekV41ForCausalLM"],
            "model_type": MODEL_TYPE,
            "text_config": text,
            "vision_config": {"num_hidden_layers": 0},
            "image_token_id": self.image_token_id,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "tie_word_embeddings": False,
            "dtype": "float32",
        }


def is_v41(raw: dict[str, Any]) -> bool:
    """Whether a config.json describes a V4.1 checkpoint."""
    return raw.get("model_type") == MODEL_TYPE or "DeepseekV41ForCausalLM" in (raw.get("architectures") or ())


def _ids(raw: dict[str, Any], key: str, default: list[int]) -> tuple[int, ...]:
    value = raw.get(key)
    return tuple(int(i) for i in (default if value is None else value))


def _parse(raw: dict[str, Any]) -> V41Config:
    num_layers = int(raw.get("num_hidden_layers", 40))
    ratios = _ids(raw, "compress_ratios", [0, 0] + [2] * 18 + [1] * 20)
    if len(ratios) < num_layers:
        raise ValueError(f"compress_ratios has {len(ratios)} entries for {num_layers} layers")
    live = set(range(num_layers))
    yarn = None
    scaling = raw.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) == "yarn" or raw.get("rope_scaling") is None:
        yarn = YarnScaling(
            factor=float(scaling.get("factor", 16)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 65536)),
            beta_fast=float(scaling.get("beta_fast", 32)),
            beta_slow=float(scaling.get("beta_slow", 1)),
        )
    engram_layers = _ids(raw, "engram_layer_ids", [1, 14])
    engram_rows = _ids(raw, "engram_num_embeddings", [384006168, 384016682] if engram_layers else [])
    kept = [i for i, layer in enumerate(engram_layers) if layer in live]
    eos = raw.get("eos_token_id", 1)
    known = {
        "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
        "q_lora_rank", "o_groups", "o_lora_rank", "sliding_window", "compress_ratios", "kv_source_layer_ids",
        "index_source_layer_ids", "index_n_heads", "index_head_dim", "index_topk", "candidate_source_layer_id",
        "candidate_topk_blocks", "candidate_block_size", "n_routed_experts", "n_shared_experts",
        "num_experts_per_tok", "moe_intermediate_size", "routed_scaling_factor", "scoring_func", "swiglu_limit",
        "hc_mult", "hc_sinkhorn_iters", "hc_eps", "rms_norm_eps", "rope_theta", "compress_rope_theta",
        "rope_scaling", "engram_layer_ids", "engram_num_embeddings", "engram_max_ngram_size", "engram_vocab_size",
        "engram_n_heads", "engram_head_dim", "engram_pad_token_id", "engram_compressed_vocab_size",
        "max_position_embeddings", "bos_token_id", "eos_token_id", "image_token_id", "num_nextn_predict_layers",
    }
    return V41Config(
        vocab_size=int(raw.get("vocab_size", 129280)),
        hidden_size=int(raw.get("hidden_size", 5120)),
        num_layers=num_layers,
        num_heads=int(raw.get("num_attention_heads", 64)),
        head_dim=int(raw.get("head_dim", 512)),
        rope_dim=int(raw.get("qk_rope_head_dim", 64)),
        q_lora_rank=int(raw.get("q_lora_rank", 1280)),
        o_groups=int(raw.get("o_groups", 8)),
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        window=int(raw.get("sliding_window", 128)),
        compress_ratios=ratios[:num_layers],
        kv_source_layers=tuple(i for i in _ids(raw, "kv_source_layer_ids", [2, 8, 14, 20]) if i in live),
        index_source_layers=tuple(i for i in _ids(raw, "index_source_layer_ids", [2, 8, 14, 20, 24, 28, 32, 36])
                                  if i in live),
        index_n_heads=int(raw.get("index_n_heads", 32)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        candidate_layer=(c if (c := int(raw.get("candidate_source_layer_id", 20))) in live else -1),
        candidate_topk_blocks=int(raw.get("candidate_topk_blocks", 2048)),
        candidate_block_size=int(raw.get("candidate_block_size", 8)),
        n_routed_experts=int(raw.get("n_routed_experts", 384)),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2304)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        swiglu_limit=float(raw.get("swiglu_limit", 10.0)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-20)),
        rope_theta=float(raw.get("rope_theta", 10000.0)),
        compress_rope_theta=float(raw.get("compress_rope_theta", 160000.0)),
        yarn=yarn,
        engram_layers=tuple(engram_layers[i] for i in kept),
        engram_num_embeddings=tuple(engram_rows[i] for i in kept),
        engram_max_ngram=int(raw.get("engram_max_ngram_size", 4)),
        engram_vocab_size=int(raw.get("engram_vocab_size", 16000000)),
        engram_n_heads=int(raw.get("engram_n_heads", 8)),
        engram_head_dim=int(raw.get("engram_head_dim", 256)),
        engram_pad_token_id=int(raw.get("engram_pad_token_id", 2)),
        engram_compressed_vocab_size=int(raw.get("engram_compressed_vocab_size", 99092)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        bos_token_id=int(raw.get("bos_token_id", 0) or 0),
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        image_token_id=int(raw.get("image_token_id", 129264)),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
        extra={k: v for k, v in raw.items() if k not in known},
    )
