"""Model configuration: one frozen dataclass, built once from a checkpoint's config.json.

Three spellings of the same architecture are accepted: the official DeepSeek-V4 `config.json`
(`compress_ratios`, `sliding_window`, `qk_rope_head_dim`, `rope_scaling`, ...), DeepSeek's
inference `ModelArgs` names (`dim`, `n_layers`, `window_size`, ...) and transformers'
`DeepseekV4Config` form (`layer_types`, `compress_rates`, `rope_parameters`, `mlp_layer_types`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import reduce
from typing import Any

LAYER_TYPE_TO_KIND = {
    "sliding_attention": "swa",
    "compressed_sparse_attention": "csa",
    "heavily_compressed_attention": "hca",
}


@dataclass(frozen=True)
class YarnScaling:
    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class ModelConfig:
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
    # One entry per layer: 0 = sliding-window only, the CSA ratio (overlapping) or the HCA ratio.
    compress_ratios: tuple[int, ...]
    # Which layers' compressors overlap (CSA, with a Lightning Indexer); the rest are HCA.
    csa_ratio: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    routed_scaling_factor: float
    scoring_func: str
    num_hash_layers: int
    swiglu_limit: float
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_theta: float
    compress_rope_theta: float
    yarn: YarnScaling | None
    max_position_embeddings: int = 1048576
    bos_token_id: int = 0
    eos_token_id: int = 1
    num_nextn_predict_layers: int = 0
    extra: dict[str, Any] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(
                f"compress_ratios has {len(self.compress_ratios)} entries for {self.num_layers} layers"
            )
        if self.rope_dim % 2 or self.rope_dim > min(self.head_dim, self.index_head_dim):
            raise ValueError(f"rope dim {self.rope_dim} must be even and fit in every head")
        if (self.num_heads * self.head_dim) % self.o_groups:
            raise ValueError("num_heads * head_dim must be divisible by o_groups")
        if self.scoring_func not in ("sqrtsoftplus", "softmax", "sigmoid"):
            raise ValueError(f"unknown scoring_func {self.scoring_func!r}")

    # ---- derived facts -------------------------------------------------------------------
    def ratio(self, layer: int) -> int:
        """A layer's compress ratio (0: window only). Past the main layers are the multi-token-prediction
        layers, which are window-only."""
        return self.compress_ratios[layer] if layer < self.num_layers else 0

    def layer_kind(self, layer: int) -> str:
        ratio = self.ratio(layer)
        if ratio == 0:
            return "swa"
        return "csa" if ratio == self.csa_ratio else "hca"

    @property
    def block_size(self) -> int:
        """Tokens per Block Cache block: every compressor boundary falls on a block edge."""
        ratios = [r for r in self.compress_ratios if r]
        return reduce(math.lcm, ratios, 1) if ratios else self.window

    @property
    def shared_intermediate_size(self) -> int:
        return self.n_shared_experts * self.moe_intermediate_size

    # ---- construction ---------------------------------------------------------------------
    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        return _parse(raw)

    def to_official_dict(self) -> dict[str, Any]:
        """The official config.json spelling, as `v4serve make-checkpoint` writes it."""
        out: dict[str, Any] = {
            "architectures": ["DeepseekV4ForCausalLM"],
            "model_type": "deepseek_v4",
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
            "compress_ratios": list(self.compress_ratios),
            "index_n_heads": self.index_n_heads,
            "index_head_dim": self.index_head_dim,
            "index_topk": self.index_topk,
            "n_routed_experts": self.n_routed_experts,
            "n_shared_experts": self.n_shared_experts,
            "num_experts_per_tok": self.num_experts_per_tok,
            "moe_intermediate_size": self.moe_intermediate_size,
            "routed_scaling_factor": self.routed_scaling_factor,
            "scoring_func": self.scoring_func,
            "norm_topk_prob": True,
            "num_hash_layers": self.num_hash_layers,
            "swiglu_limit": self.swiglu_limit,
            "hc_mult": self.hc_mult,
            "hc_sinkhorn_iters": self.hc_sinkhorn_iters,
            "hc_eps": self.hc_eps,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "compress_rope_theta": self.compress_rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "num_nextn_predict_layers": self.num_nextn_predict_layers,
            "tie_word_embeddings": False,
            "torch_dtype": "float32",
        }
        if self.yarn is not None:
            out["rope_scaling"] = {"type": "yarn", **asdict(self.yarn)}
        return out

    def to_transformers_dict(self) -> dict[str, Any]:
        """transformers' `DeepseekV4Config` spelling (needed when ratios are not 4 and 128)."""
        out = self.to_official_dict()
        for key in ("compress_ratios", "num_hash_layers", "qk_rope_head_dim", "rope_scaling"):
            out.pop(key, None)
        hca = sorted({r for r in self.compress_ratios if r and r != self.csa_ratio}) or [128]
        names = {0: "sliding_attention", self.csa_ratio: "compressed_sparse_attention"}
        out["layer_types"] = [names.get(r, "heavily_compressed_attention") for r in self.compress_ratios]
        out["compress_rates"] = {"compressed_sparse_attention": self.csa_ratio,
                                 "heavily_compressed_attention": hca[0]}
        out["mlp_layer_types"] = ["hash_moe" if i < self.num_hash_layers else "moe"
                                  for i in range(self.num_layers)]
        out["partial_rotary_factor"] = self.rope_dim / self.head_dim
        out["rope_parameters"] = {"rope_theta": self.compress_rope_theta, "rope_type": "default"}
        if self.yarn is not None:
            out["rope_parameters"] = {"rope_type": "yarn", "rope_theta": self.compress_rope_theta,
                                      **asdict(self.yarn)}
        return out


# ---- parsing ------------------------------------------------------------------------------------

_ALIASES: dict[str, tuple[str, ...]] = {
    "hidden_size": ("hidden_size", "dim"),
    "num_layers": ("num_hidden_layers", "n_layers"),
    "num_heads": ("num_attention_heads", "n_heads"),
    "window": ("sliding_window", "window_size"),
    "n_routed_experts": ("n_routed_experts", "num_local_experts"),
    "num_experts_per_tok": ("num_experts_per_tok", "n_activated_experts"),
    "moe_intermediate_size": ("moe_intermediate_size", "moe_inter_dim"),
    "routed_scaling_factor": ("routed_scaling_factor", "route_scale"),
    "scoring_func": ("scoring_func", "score_func"),
    "rms_norm_eps": ("rms_norm_eps", "norm_eps"),
    "hc_eps": ("hc_eps",),
    "max_position_embeddings": ("max_position_embeddings", "max_seq_len"),
}


def _get(raw: dict[str, Any], key: str, default: Any = None) -> Any:
    for name in _ALIASES.get(key, (key,)):
        if raw.get(name) is not None:
            return raw[name]
    if default is None:
        raise ValueError(f"config.json is missing {' / '.join(_ALIASES.get(key, (key,)))}")
    return default


def _ratios(raw: dict[str, Any], num_layers: int) -> tuple[tuple[int, ...], int]:
    if raw.get("compress_ratios") is not None:
        ratios = tuple(int(r) for r in raw["compress_ratios"])[:num_layers]
        csa = int(raw.get("compress_rate_csa") or min((r for r in ratios if r), default=4))
        return ratios, csa
    if raw.get("layer_types") is not None:
        rates = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
        rates.update(raw.get("compress_rates") or {})
        for legacy, name in (("compress_rate_csa", "compressed_sparse_attention"),
                             ("compress_rate_hca", "heavily_compressed_attention")):
            if raw.get(legacy) is not None:
                rates[name] = raw[legacy]
        ratios = tuple(0 if t == "sliding_attention" else int(rates[t]) for t in raw["layer_types"])
        return ratios[:num_layers], int(rates["compressed_sparse_attention"])
    raise ValueError("config.json has neither compress_ratios nor layer_types")


def _hash_layers(raw: dict[str, Any]) -> int:
    if raw.get("mlp_layer_types") is not None:
        kinds = list(raw["mlp_layer_types"])
        n = sum(1 for k in kinds if k == "hash_moe")
        if kinds[:n] != ["hash_moe"] * n:
            raise ValueError("hash-routed MoE layers must come first")
        return n
    return int(raw.get("num_hash_layers", raw.get("n_hash_layers", 3)))


def _rope(raw: dict[str, Any], head_dim: int) -> tuple[int, float, float, YarnScaling | None]:
    rope_dim = raw.get("qk_rope_head_dim") or raw.get("rope_head_dim")
    if rope_dim is None:
        rope_dim = int(head_dim * float(raw.get("partial_rotary_factor") or 64 / 512))
    theta = float(raw.get("rope_theta") or 10000.0)
    compress_theta = float(raw.get("compress_rope_theta") or 160000.0)
    params = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    if isinstance(params.get("compress"), dict):
        params = params["compress"]
    kind = params.get("rope_type", params.get("type", "default"))
    yarn = None
    if kind == "yarn":
        yarn = YarnScaling(
            factor=float(params.get("factor", 16.0)),
            original_max_position_embeddings=int(params.get("original_max_position_embeddings", 65536)),
            beta_fast=float(params.get("beta_fast") or 32.0),
            beta_slow=float(params.get("beta_slow") or 1.0),
        )
    return int(rope_dim), theta, compress_theta, yarn


def _parse(raw: dict[str, Any]) -> ModelConfig:
    num_layers = int(_get(raw, "num_layers"))
    head_dim = int(raw.get("head_dim") or 512)
    ratios, csa_ratio = _ratios(raw, num_layers)
    rope_dim, theta, compress_theta, yarn = _rope(raw, head_dim)
    eos = raw.get("eos_token_id", 1)
    known = set(ModelConfig.__dataclass_fields__)
    return ModelConfig(
        vocab_size=int(raw["vocab_size"]),
        hidden_size=int(_get(raw, "hidden_size")),
        num_layers=num_layers,
        num_heads=int(_get(raw, "num_heads")),
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=int(raw["q_lora_rank"]),
        o_groups=int(raw["o_groups"]),
        o_lora_rank=int(raw["o_lora_rank"]),
        window=int(_get(raw, "window")),
        compress_ratios=ratios,
        csa_ratio=csa_ratio,
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        n_routed_experts=int(_get(raw, "n_routed_experts")),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        num_experts_per_tok=int(_get(raw, "num_experts_per_tok")),
        moe_intermediate_size=int(_get(raw, "moe_intermediate_size")),
        routed_scaling_factor=float(_get(raw, "routed_scaling_factor", 1.0)),
        scoring_func=str(_get(raw, "scoring_func", "sqrtsoftplus")),
        num_hash_layers=_hash_layers(raw),
        swiglu_limit=float(raw.get("swiglu_limit") or 0.0),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(_get(raw, "hc_eps", 1e-6)),
        rms_norm_eps=float(_get(raw, "rms_norm_eps", 1e-6)),
        rope_theta=theta,
        compress_rope_theta=compress_theta,
        yarn=yarn,
        max_position_embeddings=int(_get(raw, "max_position_embeddings", 1048576)),
        bos_token_id=int(raw.get("bos_token_id", 0) or 0),
        eos_token_id=int(eos[0] if isinstance(eos, list) else eos),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 0) or 0),
        extra={k: v for k, v in raw.items() if k not in known},
    )
