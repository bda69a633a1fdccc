"""Capacity plan: weight and KV bytes per rank and whether a model fits, before any tensor data is
read. The inputs are a checkpoint folder's `config.json` and safetensors headers (read through the
loader, imported only then), or one of the built-in presets of the published models, which need
nothing but plain Python.

**Weights.** Every official tensor the loader would produce is counted once; multi-token-prediction
tensors (`mtp.*`, `num_nextn_predict_layers`) are not loaded by v4serve and are reported as skipped.
What a tensor costs once resident depends on `--weight-dtype` (resolved per device by
`resident.resolve_weight_dtype`: `auto` is `checkpoint` on a GPU, `fp32` on a CPU):

* `checkpoint`: a quantized tensor whose layer computes from packed codes
  (`resident.can_stay_quantized`) costs its checkpoint bytes, codes plus scales (FP8 e4m3: one byte
  per value and one scale per 128x128 block; FP4 e2m1: half a byte per value and one scale per 32
  values of a row). A quantized tensor that cannot stay packed (`wo_a`, stored FP8) is dequantized,
  and so is cast every other floating tensor: both cost the model dtype (bf16 on a GPU: 2 bytes per
  value), which is what the loader does with them.
* `bf16` / `fp32`: every floating tensor dequantized to 2 / 4 bytes per value.
* Integer tensors (`ffn.gate.tid2eid`) stay as stored whatever the setting, and the parameters
  `resident.held_in_fp32` names (the head, the router, mHC, sinks, `ape`) cost 4 bytes per value.

**Parallelism** (bytes are those of the largest rank; issue 14 implements exactly these rules).
`--tensor-parallel-size N` splits across the N ranks: `attn.wq_b` rows (heads), `attn.attn_sink`,
`attn.wo_a` rows (output groups), `attn.wo_b` input columns, `attn.indexer.wq_b` rows and
`attn.indexer.weights_proj` rows (index heads), the shared experts' intermediate width (w1/w3 rows,
w2 columns), the routed experts' intermediate width likewise, and the embedding and head by
vocabulary rows. Replicated on every rank: `wq_a`, `wkv`, `q_norm`, `kv_norm`, the compressors
(the indexer's included) with their `ape`, the router (`ffn.gate` weight, bias, `tid2eid`), every
norm and the mHC (`hc_*`) parameters. `--expert-parallel` gives each rank E/N whole routed
experts instead of a 1/N slice of every expert's width. N must divide the
attention heads, `o_groups`, the index heads, the routed experts' intermediate width and, under
expert parallelism, the number of routed experts; anything else is refused.

**KV.** DeepSeek-V4 has one latent KV head shared by all query heads, so tensor parallelism cannot
split the cache: every rank holds the whole State Cache (per request, fixed size: window rings and
compressor tails) and the whole Block Cache (compressed entries and indexer keys per block of
`block_size` tokens), both at the compute dtype, or as FP8 records under `--kv-cache-dtype fp8`
(`cache.layout`). One sequence of L tokens needs its State Cache slot plus ceil(L/block) blocks.

**Reserve.** Activations and workspace of one engine step, a stated estimate: the step's
`max_num_batched_tokens` tokens times the widest per-token activation (the largest of the mHC
residual streams hc_mult x hidden, the query heads x head_dim, the index heads x index_head_dim
and the chosen experts' top_k x 2 x moe_intermediate gate/up output), in fp32, four such buffers
live at once (input, output and two temporaries), plus the fp32 logits of `max_num_seqs` sampled
rows, plus the slot states a step may capture inside its prefill chunks for snapshots
(`cache.config.MAX_CAPTURED_STATES` State Cache slots' worth). It is not divided by the
tensor-parallel size (a conservative bound). What else the runtime
needs (CUDA context, allocator slack, kernels' scratch) is left to the (1 - utilization) margin, as
vLLM's `gpu_memory_utilization` does.

**Fit.** usable = memory x utilization (0.90 by default); the KV budget is usable - weights -
reserve; the largest number of concurrent sequences at L is floor(budget / (state per request +
ceil(L/block) x block bytes)), and the model fits when that is at least one.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from v4serve.cache.config import MAX_CAPTURED_STATES
from v4serve.cache.layout import COMPUTE_ITEMSIZE, KVLayout, check_kv_cache_dtype, key_record
from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.weights.resident import can_stay_quantized, held_in_fp32, resolve_weight_dtype

GIB = 1 << 30
DEFAULT_UTILIZATION = 0.90
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048  # serve's default token budget of one step
DEFAULT_MAX_NUM_SEQS = 16  # serve's default State Cache slots
DEFAULT_MAX_MODEL_LEN = 32768  # serve's default, capped by the model's max_position_embeddings
_LIVE_BUFFERS = 4
_FP32 = 4

# The checkpoint formats (as engine/model/weights/quant.py, which needs torch): FP8 e4m3 with one scale per
# 128x128 block, FP4 e2m1 two codes per byte with one scale per 32 values along a row.
FP8_BLOCK = 128
FP4_GROUP = 32
_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}
_INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
_ITEM_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2, "U16": 2}
_COMPUTE_DTYPES = COMPUTE_ITEMSIZE
_DEQUANTIZED_ITEMSIZE = {"bf16": 2, "fp32": 4}

KINDS = ("attention", "routed_experts", "shared_experts", "embedding_and_head", "other")


class PlanError(ValueError):
    """Input the plan cannot be made for (unknown model, a parallel size that does not divide, ...)."""


# ---------------------------------------------------------------------------------------------
# Presets: the published config.json of each model, verbatim in its official spelling.
#
# Checked against public copies of the published configs (found with the search tools): V4-Flash
# as quoted verbatim by several independent projects (43 layers, hidden 4096, 64 heads, 256 routed + 1 shared experts of
# width 2048, top-6, index top-k 512, 3 hash layers, routed_scaling_factor 1.5, compress_ratios of
# 44 entries, the last one for the MTP layer); V4-Pro from a dump of its config.json and full header
# listing (61 layers, hidden 7168, 128 heads, q_lora 1536, o_groups 16, 384 experts of width 3072,
# index 64 heads x 128 top-1024, num_hash_layers 3 (tid2eid on layers 0-2), routed_scaling_factor
# 2.5, 62 compress_ratios). The checkpoint dtypes below (`checkpoint_tensors`) follow those header
# listings: wo_a is FP8 like the other attention projections, tid2eid is I64, attn_sink, ape, the
# router bias and the hc_* parameters are F32, norms, compressors, weights_proj, embed and head BF16.
# Totals with the MTP layer: Flash 159.61 GB (published "~160 GB"), Pro 864.70 GB = 805.32 GiB
# (the dump's 805.32). A V4-Flash shard listing (one block per shard) agrees too: 3,566,321,192 bytes
# for a window-only hash layer, 3,568,768,976 for an HCA and 3,590,024,776 for a CSA layer, each the
# data computed here plus its ~170 KB header.

DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 43,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                        4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0],
}

DEEPSEEK_V4_PRO: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "hc_eps": 1e-06,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 1024,
    "initializer_range": 0.02,
    "max_position_embeddings": 1048576,
    "model_type": "deepseek_v4",
    "moe_intermediate_size": 3072,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 61,
    "num_hash_layers": 3,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 16,
    "o_lora_rank": 1024,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 16, "original_max_position_embeddings": 65536,
                     "type": "yarn"},
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "transformers_version": "4.57.1",
    "use_cache": True,
    "vocab_size": 129280,
    "compress_rope_theta": 160000,
    "compress_ratios": [128, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                        4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128,
                        4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 128, 4, 0],
}

PRESETS: dict[str, dict[str, Any]] = {"deepseek-v4-flash": DEEPSEEK_V4_FLASH, "deepseek-v4-pro": DEEPSEEK_V4_PRO}


def preset_config(name: str) -> ModelConfig:
    if name not in PRESETS:
        raise PlanError(f"unknown preset {name!r}; presets: {', '.join(PRESETS)}")
    return ModelConfig.from_dict(dict(PRESETS[name]))


# ---------------------------------------------------------------------------------------------
# Tensors as a checkpoint stores them


@dataclass(frozen=True)
class StoredTensor:
    """One official tensor as its checkpoint stores it (from a header, or what a real checkpoint of
    a preset holds)."""

    name: str  # official name, `layers.3.attn.wq_b.weight`
    shape: tuple[int, ...]  # logical shape: FP4 unpacked, one expert of a merged tensor
    dtype: str  # safetensors dtype of the stored values or codes: F8_E4M3, I8 (packed FP4), BF16, ...
    scale_dtype: str | None = None  # the scales' dtype when quantized (F8_E8M0, U8, F32, ...)

    @property
    def quant(self) -> str | None:
        if self.scale_dtype is None:
            return None
        return "fp8" if self.dtype in _FP8_DTYPES else "fp4"

    @property
    def is_int(self) -> bool:
        return self.quant is None and self.dtype in _INT_DTYPES

    def stored_bytes(self, shape: tuple[int, ...] | None = None) -> int:
        """Checkpoint bytes (codes and scales) of this tensor, or of a shard of it of `shape`."""
        return _stored_bytes(self.shape if shape is None else shape, self.dtype, self.scale_dtype)


@lru_cache(maxsize=4096)  # a real model has ~70k tensors but only a few dozen (shape, format) pairs
def _stored_bytes(shape: tuple[int, ...], dtype: str, scale_dtype: str | None) -> int:
    if scale_dtype is None:
        return math.prod(shape) * _ITEM_BYTES.get(dtype, 1)
    scale_item = _ITEM_BYTES.get(scale_dtype, 1)
    *lead, rows, cols = shape if len(shape) >= 2 else (1, *shape)
    if dtype in _FP8_DTYPES:
        return math.prod(shape) + math.prod(lead) * _ceil(rows, FP8_BLOCK) * _ceil(cols, FP8_BLOCK) * scale_item
    return math.prod(lead) * rows * (_ceil(cols, 2) + _ceil(cols, FP4_GROUP) * scale_item)


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _fp8(name: str, *shape: int) -> StoredTensor:
    return StoredTensor(f"{name}.weight", shape, "F8_E4M3", "F8_E8M0")


def _fp4(name: str, *shape: int) -> StoredTensor:
    return StoredTensor(f"{name}.weight", shape, "I8", "F8_E8M0")


def _bf16(name: str, *shape: int) -> StoredTensor:
    return StoredTensor(name, shape, "BF16")


def _f32(name: str, *shape: int) -> StoredTensor:
    return StoredTensor(name, shape, "F32")


def checkpoint_tensors(cfg: ModelConfig) -> list[StoredTensor]:
    """Every tensor v4serve loads from a real DeepSeek-V4 checkpoint of `cfg`, at the precision the
    published checkpoints use (see the presets' comment)."""
    d = cfg.hidden_size
    tensors = [_bf16("embed.weight", cfg.vocab_size, d), _bf16("head.weight", cfg.vocab_size, d),
               _bf16("norm.weight", d), *_hc_head("", cfg)]
    for i in range(cfg.num_layers):
        p = f"layers.{i}."
        tensors += [*_mhc(p, cfg), _bf16(p + "attn_norm.weight", d), _bf16(p + "ffn_norm.weight", d)]
        tensors += _attention(p + "attn.", cfg, cfg.compress_ratios[i], cfg.layer_kind(i) == "csa")
        tensors += _moe(p + "ffn.", cfg, hashed=i < cfg.num_hash_layers)
    return tensors


def mtp_tensors(cfg: ModelConfig) -> list[StoredTensor]:
    """The multi-token-prediction blocks a real checkpoint adds (v4serve loads the first for speculative
    decoding with method 'mtp', and skips them otherwise): a window-only block with its own
    embedding/hidden projections, norms and mHC head."""
    d = cfg.hidden_size
    tensors: list[StoredTensor] = []
    for k in range(cfg.num_nextn_predict_layers):
        p = f"mtp.{k}."
        tensors += [*_mhc(p, cfg), *_hc_head(p, cfg), _bf16(p + "attn_norm.weight", d),
                    _bf16(p + "ffn_norm.weight", d), _fp8(p + "e_proj", d, d), _fp8(p + "h_proj", d, d)]
        tensors += [_bf16(p + f"{n}.weight", d) for n in ("enorm", "hnorm", "norm")]
        tensors += _attention(p + "attn.", cfg, 0, False) + _moe(p + "ffn.", cfg, hashed=False)
    return tensors


def _hc_head(p: str, cfg: ModelConfig) -> list[StoredTensor]:
    hc = cfg.hc_mult
    return [_f32(p + "hc_head_fn", hc, hc * cfg.hidden_size), _f32(p + "hc_head_base", hc),
            _f32(p + "hc_head_scale", 1)]


def _mhc(p: str, cfg: ModelConfig) -> list[StoredTensor]:
    hc = cfg.hc_mult
    mix = (2 + hc) * hc
    return [t for part in ("attn", "ffn") for t in (_f32(f"{p}hc_{part}_fn", mix, hc * cfg.hidden_size),
                                                    _f32(f"{p}hc_{part}_base", mix), _f32(f"{p}hc_{part}_scale", 3))]


def _attention(p: str, cfg: ModelConfig, ratio: int, csa: bool) -> list[StoredTensor]:
    d, hd, heads, q, groups = cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.q_lora_rank, cfg.o_groups
    tensors = [
        _f32(p + "attn_sink", heads), _fp8(p + "wq_a", q, d), _bf16(p + "q_norm.weight", q),
        _fp8(p + "wq_b", heads * hd, q), _fp8(p + "wkv", hd, d), _bf16(p + "kv_norm.weight", hd),
        _fp8(p + "wo_a", groups * cfg.o_lora_rank, heads * hd // groups), _fp8(p + "wo_b", d, groups * cfg.o_lora_rank),
    ]
    if ratio:
        tensors += _compressor(p + "compressor.", ratio, hd, d, overlap=csa)
    if csa:
        ih, idim = cfg.index_n_heads, cfg.index_head_dim
        tensors += [_fp8(p + "indexer.wq_b", ih * idim, q), _bf16(p + "indexer.weights_proj.weight", ih, d)]
        tensors += _compressor(p + "indexer.compressor.", ratio, idim, d, overlap=True)
    return tensors


def _compressor(p: str, ratio: int, width: int, d: int, overlap: bool) -> list[StoredTensor]:
    out = (2 if overlap else 1) * width
    return [_f32(p + "ape", ratio, out), _bf16(p + "wkv.weight", out, d), _bf16(p + "wgate.weight", out, d),
            _bf16(p + "norm.weight", width)]


def _moe(p: str, cfg: ModelConfig, hashed: bool) -> list[StoredTensor]:
    d, inter, shared = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_intermediate_size
    router = StoredTensor(p + "gate.tid2eid", (cfg.vocab_size, cfg.num_experts_per_tok), "I64") if hashed \
        else _f32(p + "gate.bias", cfg.n_routed_experts)
    tensors = [_bf16(p + "gate.weight", cfg.n_routed_experts, d), router]
    for e in range(cfg.n_routed_experts):
        x = f"{p}experts.{e}."
        tensors += [_fp4(x + "w1", inter, d), _fp4(x + "w2", d, inter), _fp4(x + "w3", inter, d)]
    if shared:
        x = p + "shared_experts."
        tensors += [_fp8(x + "w1", shared, d), _fp8(x + "w2", d, shared), _fp8(x + "w3", shared, d)]
    return tensors


# ---------------------------------------------------------------------------------------------
# Per-rank bytes

# (pattern, axis) of the tensors tensor parallelism splits; every other tensor is replicated.
_TP_SPLIT: tuple[tuple[re.Pattern[str], int], ...] = (
    (re.compile(r"\.attn\.(?:wq_b|wo_a|indexer\.wq_b|indexer\.weights_proj)\.weight$|\.attn\.attn_sink$"), 0),
    (re.compile(r"\.attn\.wo_b\.weight$"), 1),
    (re.compile(r"\.ffn\.(?:shared_experts|experts\.\d+)\.w[13]\.weight$"), 0),
    (re.compile(r"\.ffn\.(?:shared_experts|experts\.\d+)\.w2\.weight$"), 1),
    (re.compile(r"^(?:embed|head)\.weight$"), 0),
)
_ROUTED_EXPERT = re.compile(r"\.ffn\.experts\.(\d+)\.")
_INDEX = re.compile(r"\.\d+\.")


def weight_kind(name: str) -> str:
    """Which line of the table an official tensor is counted in."""
    if name in ("embed.weight", "head.weight"):
        return "embedding_and_head"
    if ".ffn.experts." in name:
        return "routed_experts"
    if ".ffn.shared_experts." in name:
        return "shared_experts"
    if ".attn." in name:
        return "attention"
    return "other"  # router, norms, mHC parameters


def tp_split_axis(name: str) -> int | None:
    """The axis along which tensor parallelism splits an official tensor (0 rows, 1 columns), or
    None when every rank holds all of it (the rules of the module docstring)."""
    return _name_facts(_INDEX.sub(".0.", name))[1]


def routed_expert_of(name: str) -> int | None:
    """The routed expert an official tensor belongs to (`layers.3.ffn.experts.7.w1.weight` → 7)."""
    match = _ROUTED_EXPERT.search(name)
    return None if match is None else int(match.group(1))


@lru_cache(maxsize=1024)
def _name_facts(template: str) -> tuple[str, int | None, bool]:
    """(table line, tensor-parallel split axis or None, may stay packed) of a name whose layer and
    expert numbers are all 0, so the ~70k tensors of a real model share a few dozen look-ups."""
    axis = next((axis for pattern, axis in _TP_SPLIT if pattern.search(template)), None)
    return weight_kind(template), axis, can_stay_quantized(template)


@dataclass(frozen=True)
class WeightBytes:
    attention: int = 0
    routed_experts: int = 0
    shared_experts: int = 0
    embedding_and_head: int = 0
    other: int = 0

    @property
    def total(self) -> int:
        return sum(getattr(self, kind) for kind in KINDS)

    def to_dict(self) -> dict[str, int]:
        return {**{kind: getattr(self, kind) for kind in KINDS}, "total": self.total}


@dataclass(frozen=True)
class _Residency:
    """How one rank holds the weights: parallel layout and the dtype of what gets dequantized."""

    tp: int
    ep: bool
    experts_per_rank: int
    weight_dtype: str  # resolved: checkpoint, bf16 or fp32
    float_itemsize: int  # the model dtype's bytes: what `checkpoint` casts unpacked floats to

    def rank_bytes(self, tensor: StoredTensor, axis: int | None, packable: bool) -> int:
        """Bytes of `tensor` on the largest rank (rank 0: it gets the ceil of every split)."""
        expert = routed_expert_of(tensor.name) if self.ep else None
        if expert is not None:
            held = expert < self.experts_per_rank
            return self.resident_bytes(tensor, tensor.shape, packable) if held else 0
        shape = tensor.shape
        if axis is not None and self.tp > 1:
            shape = (*shape[:axis], _ceil(shape[axis], self.tp), *shape[axis + 1:])
        return self.resident_bytes(tensor, shape, packable)

    def resident_bytes(self, tensor: StoredTensor, shape: tuple[int, ...], packable: bool) -> int:
        if tensor.is_int or (tensor.quant and packable and self.weight_dtype == "checkpoint"):
            return tensor.stored_bytes(shape)
        if held_in_fp32(tensor.name):
            return math.prod(shape) * 4
        return math.prod(shape) * _DEQUANTIZED_ITEMSIZE.get(self.weight_dtype, self.float_itemsize)


def weight_bytes_per_rank(tensors: Iterable[StoredTensor], residency: _Residency) -> WeightBytes:
    sums = dict.fromkeys(KINDS, 0)
    for tensor in tensors:
        kind, axis, packable = _name_facts(_INDEX.sub(".0.", tensor.name))
        sums[kind] += residency.rank_bytes(tensor, axis, packable)
    return WeightBytes(**sums)


def check_parallel(cfg: ModelConfig, tp: int, ep: bool) -> None:
    """Refuse a parallel size that would leave ranks with parts of a head, group or expert."""
    if tp < 1:
        raise PlanError(f"--tensor-parallel-size must be at least 1, got {tp}")
    sizes = {"attention heads": cfg.num_heads, "o_groups": cfg.o_groups,
             "routed experts' intermediate width": cfg.moe_intermediate_size}
    if any(cfg.layer_kind(i) == "csa" for i in range(cfg.num_layers)):
        sizes["index heads"] = cfg.index_n_heads
    if ep:
        sizes["routed experts"] = cfg.n_routed_experts
    bad = [f"{what} ({n})" for what, n in sizes.items() if n % tp]
    if bad:
        raise PlanError(f"--tensor-parallel-size {tp} does not divide the {', '.join(bad)}")


# ---------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class PlanSettings:
    memory_bytes: int  # per rank
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    device: str = "cuda"
    weight_dtype: str = "auto"
    compute_dtype: str | None = None  # the model dtype; default bfloat16 on a GPU, float32 on a CPU
    kv_cache_dtype: str = "auto"
    max_model_len: int | None = None  # default as serve: min(max_position_embeddings, 32768)
    memory_utilization: float = DEFAULT_UTILIZATION
    max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    mtp: bool = False  # the first multi-token-prediction layer is loaded (speculative method 'mtp')

    def check(self) -> None:
        check_kv_cache_dtype(self.kv_cache_dtype)
        resolve_weight_dtype(self.weight_dtype, self.device)
        if self.memory_bytes <= 0:
            raise PlanError(f"device memory must be positive, got {self.memory_bytes} bytes")
        if not 0 < self.memory_utilization <= 1:
            raise PlanError(f"memory utilization must be in (0, 1], got {self.memory_utilization}")
        if self.compute_dtype is not None and self.compute_dtype not in _COMPUTE_DTYPES:
            raise PlanError(f"compute dtype must be one of {', '.join(_COMPUTE_DTYPES)}, got {self.compute_dtype!r}")
        for name in ("max_model_len", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise PlanError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    @property
    def resolved_compute_dtype(self) -> str:
        if self.compute_dtype is not None:
            return self.compute_dtype
        return "bfloat16" if self.device.split(":")[0] == "cuda" else "float32"


@dataclass(frozen=True)
class CapacityPlan:
    model: str
    source: str  # "preset" or the checkpoint folder
    settings: PlanSettings
    weight_dtype: str  # resolved: checkpoint, bf16 or fp32
    num_layers: int
    max_model_len: int
    checkpoint_bytes: int  # the loaded tensors as stored, all ranks together
    mtp_layers_loaded: int  # multi-token-prediction layers counted in (for speculative decoding)
    mtp_layers_skipped: int
    mtp_tensors_skipped: int
    mtp_bytes_skipped: int
    weights_per_rank: WeightBytes
    state_cache_bytes_per_request: int
    block_cache_bytes_per_block: int
    block_size: int
    activation_reserve_bytes: int

    @property
    def usable_bytes(self) -> int:
        return int(self.settings.memory_bytes * self.settings.memory_utilization)

    @property
    def kv_bytes_per_sequence(self) -> int:
        blocks = _ceil(self.max_model_len, self.block_size)
        return self.state_cache_bytes_per_request + blocks * self.block_cache_bytes_per_block

    @property
    def kv_budget_bytes(self) -> int:
        return self.usable_bytes - self.weights_per_rank.total - self.activation_reserve_bytes

    @property
    def max_concurrent_sequences(self) -> int:
        return max(0, self.kv_budget_bytes // self.kv_bytes_per_sequence)

    @property
    def fits(self) -> bool:
        return self.max_concurrent_sequences >= 1

    @property
    def reason(self) -> str:
        need = self.weights_per_rank.total + self.activation_reserve_bytes + self.kv_bytes_per_sequence
        sign = "<=" if self.fits else ">"
        return (f"weights {_size(self.weights_per_rank.total)} + reserve {_size(self.activation_reserve_bytes)} + "
                f"one sequence of {self.max_model_len} tokens {_size(self.kv_bytes_per_sequence)} = {_size(need)} "
                f"{sign} usable {_size(self.usable_bytes)} per rank")

    def to_dict(self) -> dict[str, Any]:
        s = self.settings
        return {
            "model": self.model, "source": self.source, "fits": self.fits, "reason": self.reason,
            "device": s.device, "tensor_parallel_size": s.tensor_parallel_size, "expert_parallel": s.expert_parallel,
            "weight_dtype": self.weight_dtype, "compute_dtype": s.resolved_compute_dtype,
            "kv_cache_dtype": s.kv_cache_dtype, "num_layers": self.num_layers,
            "mtp_layers_loaded": self.mtp_layers_loaded,
            "skipped": {"mtp_layers": self.mtp_layers_skipped, "mtp_tensors": self.mtp_tensors_skipped,
                        "mtp_bytes": self.mtp_bytes_skipped},
            "checkpoint_bytes": self.checkpoint_bytes,
            "weight_bytes_per_rank": self.weights_per_rank.to_dict(),
            "state_cache_bytes_per_request": self.state_cache_bytes_per_request,
            "block_size_tokens": self.block_size,
            "block_cache_bytes_per_block": self.block_cache_bytes_per_block,
            "block_cache_bytes_per_token": self.block_cache_bytes_per_block / self.block_size,
            "max_model_len": self.max_model_len,
            "kv_bytes_per_sequence": self.kv_bytes_per_sequence,
            "gpu_memory_bytes": s.memory_bytes, "gpu_memory_utilization": s.memory_utilization,
            "usable_bytes": self.usable_bytes,
            "activation_reserve_bytes": self.activation_reserve_bytes,
            "kv_budget_bytes": self.kv_budget_bytes,
            "max_concurrent_sequences": self.max_concurrent_sequences,
        }

    def table(self) -> str:
        return "\n".join(_table_lines(self))


def plan_model(model: str, settings: PlanSettings) -> CapacityPlan:
    """The plan of a preset name or a checkpoint folder."""
    if model in PRESETS:
        return plan_preset(model, settings)
    if not Path(model).is_dir():
        raise PlanError(f"--model must be a checkpoint folder or a preset ({', '.join(PRESETS)}); "
                        f"{model} is neither")
    return plan_checkpoint(model, settings)


def plan_preset(name: str, settings: PlanSettings) -> CapacityPlan:
    cfg = preset_config(name)
    mtp = mtp_tensors(cfg)
    loaded = [t for t in mtp if settings.mtp and t.name.startswith("mtp.0.")]
    skipped = [t for t in mtp if t not in loaded]
    return build_plan(cfg, checkpoint_tensors(cfg) + loaded, settings, model=name, source="preset",
                      mtp=(sum(1 + (t.quant is not None) for t in skipped), sum(t.stored_bytes() for t in skipped)))


def plan_checkpoint(folder: str | Path, settings: PlanSettings) -> CapacityPlan:
    """From `config.json` and the safetensors headers; no tensor data is read."""
    from v4serve.engine.model.weights.files import read_config_json  # torch: only for folders
    from v4serve.engine.model.weights.layout import scan_headers

    settings.check()
    cfg = ModelConfig.from_dict(read_config_json(folder))
    scan = scan_headers(folder, mtp=settings.mtp and cfg.num_nextn_predict_layers > 0)
    tensors = [StoredTensor(name, tuple(shape), dtype, scale) for name, shape, dtype, scale in scan.tensors]
    return build_plan(cfg, tensors, settings, model=Path(folder).name, source=str(folder),
                      mtp=(scan.mtp_tensors, scan.mtp_bytes))


def build_plan(cfg: ModelConfig, tensors: list[StoredTensor], settings: PlanSettings, model: str, source: str,
               mtp: tuple[int, int]) -> CapacityPlan:
    settings.check()
    tp, ep = settings.tensor_parallel_size, settings.expert_parallel
    check_parallel(cfg, tp, ep)
    compute = settings.resolved_compute_dtype
    itemsize = _COMPUTE_DTYPES[compute]
    residency = _Residency(tp=tp, ep=ep, experts_per_rank=_ceil(cfg.n_routed_experts, tp),
                           weight_dtype=resolve_weight_dtype(settings.weight_dtype, settings.device),
                           float_itemsize=itemsize)
    mtp_loaded = int(settings.mtp and cfg.num_nextn_predict_layers > 0)
    layout = KVLayout.from_config(cfg, key_record(cfg.head_dim, cfg.rope_dim, compute, settings.kv_cache_dtype),
                                  mtp_layers=mtp_loaded)
    return CapacityPlan(
        model=model, source=source, settings=settings, weight_dtype=residency.weight_dtype,
        num_layers=cfg.num_layers, max_model_len=settings.max_model_len or default_max_model_len(cfg),
        checkpoint_bytes=sum(t.stored_bytes() for t in tensors),
        mtp_layers_loaded=mtp_loaded, mtp_layers_skipped=cfg.num_nextn_predict_layers - mtp_loaded,
        mtp_tensors_skipped=mtp[0], mtp_bytes_skipped=mtp[1],
        weights_per_rank=weight_bytes_per_rank(tensors, residency),
        state_cache_bytes_per_request=layout.state_bytes_per_slot(itemsize),
        block_cache_bytes_per_block=layout.block_bytes(itemsize), block_size=layout.block_size,
        activation_reserve_bytes=(activation_reserve(cfg, settings.max_num_batched_tokens, settings.max_num_seqs)
                                  + MAX_CAPTURED_STATES * layout.state_bytes_per_slot(itemsize)),
    )


def default_max_model_len(cfg: ModelConfig) -> int:
    return min(cfg.max_position_embeddings, DEFAULT_MAX_MODEL_LEN)


def activation_reserve(cfg: ModelConfig, max_num_batched_tokens: int, max_num_seqs: int) -> int:
    """The stated activation/workspace estimate of one engine step (see the module docstring)."""
    width = max(cfg.hc_mult * cfg.hidden_size, cfg.num_heads * cfg.head_dim, cfg.index_n_heads * cfg.index_head_dim,
                cfg.num_experts_per_tok * 2 * cfg.moe_intermediate_size)
    return max_num_batched_tokens * width * _FP32 * _LIVE_BUFFERS + max_num_seqs * cfg.vocab_size * _FP32


# ---------------------------------------------------------------------------------------------
# The table

_LABELS = {"attention": "attention", "routed_experts": "routed experts", "shared_experts": "shared experts",
           "embedding_and_head": "embedding and head", "other": "other (router, norms, mHC)"}
_WEIGHT_DTYPE_TEXT = {"checkpoint": "checkpoint precision (FP8/FP4 kept where kernels read them packed)",
                      "bf16": "all dequantized to bf16", "fp32": "all dequantized to fp32"}


def _table_lines(plan: CapacityPlan) -> Iterator[str]:
    s = plan.settings
    skipped = "; MTP layer loaded for speculative decoding" if plan.mtp_layers_loaded else ""
    skipped += f"; MTP layers not loaded: {plan.mtp_layers_skipped}" if plan.mtp_layers_skipped else ""
    if plan.mtp_bytes_skipped:
        skipped += f" ({plan.mtp_tensors_skipped} tensors, {_size(plan.mtp_bytes_skipped)})"
    parallel = f"tensor parallel {s.tensor_parallel_size}" + (", expert parallel" if s.expert_parallel else "")
    kv = "FP8 keys" if s.kv_cache_dtype == "fp8" else s.resolved_compute_dtype
    yield f"Capacity plan: {plan.model} ({plan.source}, {plan.num_layers} layers{skipped})"
    yield (f"  {parallel} on {s.device}; weights {_WEIGHT_DTYPE_TEXT[plan.weight_dtype]}, "
           f"compute {s.resolved_compute_dtype}; KV {kv}")
    yield (f"Weights per rank (the checkpoint stores {_size(plan.checkpoint_bytes)} = "
           f"{plan.checkpoint_bytes / 1e9:,.2f} GB of them in all)")
    for kind in KINDS:
        yield _row(_LABELS[kind], _size(getattr(plan.weights_per_rank, kind)))
    yield _row("total", _size(plan.weights_per_rank.total))
    yield "KV cache per rank (one latent KV head shared by all heads: every rank holds all of it)"
    yield _row("State Cache per request", _size(plan.state_cache_bytes_per_request))
    per_token = plan.block_cache_bytes_per_block / plan.block_size
    yield _row("Block Cache per token", f"{per_token:,.1f} B ({_size(plan.block_cache_bytes_per_block)} "
                                        f"per {plan.block_size}-token block)")
    yield _row(f"one sequence of {plan.max_model_len} tokens", _size(plan.kv_bytes_per_sequence))
    yield "Memory per rank"
    yield _row("device memory", f"{_size(s.memory_bytes)} x {s.memory_utilization:.2f} = "
                                f"{_size(plan.usable_bytes)} usable")
    yield _row("activation reserve", f"{_size(plan.activation_reserve_bytes)} ({s.max_num_batched_tokens} "
                                     f"batched tokens, fp32, {_LIVE_BUFFERS} buffers, + logits)")
    yield _row("left for KV", _size(plan.kv_budget_bytes))
    yield f"Max concurrent sequences at {plan.max_model_len} tokens: {plan.max_concurrent_sequences}"
    yield f"Fits: {'yes' if plan.fits else 'no'}: {plan.reason}"


def _row(label: str, value: str) -> str:
    return f"  {label:<34}{value}"


def _size(n: float) -> str:
    sign, n = ("-" if n < 0 else ""), abs(n)
    for unit, scale in (("GiB", GIB), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:,.2f} {unit}"
    return f"{sign}{n:.0f} B"
