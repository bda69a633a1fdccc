"""NVIDIA NeMo AutoModel's DeepSeek-V4.1 (`nemo_automodel.components.models.deepseek_v41`, nemo-automodel 0.7.0,
Apache-2.0) as the numerical oracle of v4serve's DeepSeek-V4.1 path.

Run with the oracle's own environment (`make v41-oracle` builds `.venv-v41oracle`: nemo-automodel pins
transformers 5.18, v4serve's environment has 5.23), never with v4serve's:

    .venv-v41oracle/bin/python tests/oracles/nemo_v41.py make --config tiny --out DIR --seed 0
    .venv-v41oracle/bin/python tests/oracles/nemo_v41.py forward --ckpt DIR --ids IDS.json --out LOGITS.pt [--hidden]
    .venv-v41oracle/bin/python tests/oracles/nemo_v41.py round --values X.pt --out ROUNDED.pt
    .venv-v41oracle/bin/python tests/oracles/nemo_v41.py config tiny            # print a preset's config.json

`make` builds a random tiny DeepSeek-V4.1 from a nested config.json (a file, or a preset named below) and writes
DIR/config.json, DIR/model.safetensors (+ model.safetensors.index.json) under the released checkpoint's tensor
names and storage formats, and DIR/tokenizer.json (+ tokenizer_config.json): Engram hashes through the
tokenizer's normalized vocabulary, so a checkpoint with Engram layers carries its tokenizer, as the real one does.
Storage (what nemo's state-dict adapter reads back; nemo itself only dequantizes, so the writer is here):
- FP8 E4M3 with float8_e8m0fnu scales over 32x32 blocks, scale [ceil(rows/32), ceil(cols/32)]:
  attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b, ffn.shared_experts.w{1,2,3}, engram.wkv;
- FP4 E2M1 routed experts ffn.experts.{j}.w{1,2,3}: int8 [rows, cols/2] (even column in the low nibble, sign
  in bit 3 of each nibble), e8m0 scales [rows, cols/32];
- Engram tables engram.embed: FP8 E4M3 [rows, head_dim], e8m0 scales [rows, head_dim/32];
- everything else in the dtype nemo gives it in a bfloat16 model: FP32 for hc_{attn,ffn}_{fn,base,scale},
  attn.attn_sink, attn.compressor.{wkv,wgate}, ffn.gate.bias, ffn.gate.bias_vl, head; BF16 for the rest.
Scales are powers of two (amax/448 resp. amax/6 rounded up to one). `--dtype fp32` writes every tensor unquantized
in FP32 under the same names (no scales, no quantization_config), for debugging.

`forward` loads DIR the way nemo initializes from a base checkpoint (its safetensors reader, then the model's
DeepseekV41StateDictAdapter.from_hf, which dequantizes and renames), strictly (every parameter and persistent
buffer from the file), builds the model in FP32 with the plain-torch backends (`BACKEND`), and runs one
full-sequence forward on CPU, deterministically (bitwise, for a given --threads): a torch.save'd dict with
"logits" [T, vocab] FP32 and "ids" [T]; with --hidden also "embed" [T, hidden], per block i
"layers.{i}.streams" [T, hc_mult, hidden] (the residual streams after the block) and "layers.{i}.pre_mix"
[T, hc_mult] (the collapse coefficients it hands to the next block), per index-source layer "layers.{i}.topk"
[T, index_topk] (picked compressed entries, ascending, -1 = none) and at the candidate source
"layers.{i}.candidates" [T, T/ratio] (bool), and "final_norm" [T, hidden] (the head's input); with --diag
"topk": per indexer top-k, how many rows select and how many have a tie at the boundary (--stable-topk breaks
those lowest index first, v4serve's rule: torch.topk leaves the order unspecified). nemo keeps the released
model's activation rounding inside the forward (quantize/dequantize of the window KV to FP8, the compressed KV to
NVFP4, the indexer's queries and keys to MXFP4); --no-kv-quant drops all three (for an exact comparison); `round`
applies them to a tensor.

Only nemo_automodel, torch, safetensors and transformers are imported, inside the commands; the module itself
imports only the standard library, so v4serve's tests can read `PRESETS` without nemo installed.

Config keys nemo's DeepseekV41TextConfig reads (`text_config`), with the released Flash value (nemo's default):
  vocab_size 129280; hidden_size 5120; moe_intermediate_size 2304 (each routed and the shared expert);
  num_hidden_layers 40; num_attention_heads 64; num_key_value_heads 1 (must be 1: one shared latent KV);
  head_dim 512 (q/k/v width, KV = one vector per token); qk_rope_head_dim 64 (rotary on the LAST 64 channels,
  adjacent pairs); q_lora_rank 1280; o_lora_rank 1024; o_groups 8 (grouped output projection wo_a);
  hidden_act silu; swiglu_limit 10.0 (gate clamped above, up clamped to +-limit, routed and shared experts);
  rms_norm_eps 1e-20 (every RMSNorm, also the mHC and Engram normalizations); attention_bias false;
  attention_dropout 0; initializer_range 0.02; max_position_embeddings 1048576; rope_theta 10000 (window-only
  layers, no YaRN); rope_scaling {yarn, factor 16, beta_fast 32, beta_slow 1, original_max_position_embeddings
  65536} (compressed layers only); compress_rope_theta 160000 (compressed layers, window KV included);
  n_routed_experts 384; n_shared_experts 1 (must be 1); num_experts_per_tok 6; scoring_func sqrtsoftplus (the
  gate always uses it); topk_method noaux_tc (not read by the model); norm_topk_prob true;
  routed_scaling_factor 1.5; sliding_window 128;
  compress_ratios [0,0]+[2]*18+[1]*20+[0]*3 (one per layer, 43 entries for 40 layers: the 3 trailing ones are
  the DSpark draft's; 0 = window only, 2 = entries pooled from 2 tokens, 1 = one entry per token);
  kv_source_layer_ids [2,8,14,20] (layers with a compressor and indexer keys; later compressed layers up to the
  next source reuse them; ratio must match the source's); index_source_layer_ids [2,8,14,20,24,28,32,36]
  (layers that pick top-k entries; must include every KV source; 24..36 are re-index layers);
  index_n_heads 32; index_head_dim 128; index_topk 512;
  candidate_source_layer_id 20 (-1 disables; an index source whose scores keep the candidate_topk_blocks best
  blocks of candidate_block_size entries per query, the latest visible block always kept; every later index
  source picks its top-k only among them); candidate_topk_blocks 2048; candidate_block_size 8;
  hc_mult 4; hc_sinkhorn_iters 20; hc_eps 1e-6;
  engram_layer_ids [1,14]; engram_num_embeddings [384006168, 384016682] (table rows per Engram layer, at least
  the sum of its primes); engram_max_ngram_size 4 (n-grams 2..4); engram_vocab_size 16000000 (each hash head's
  bucket count is the next unused prime above it); engram_n_heads 8 (heads per n-gram size: 24 lookups a layer);
  engram_head_dim 256; engram_pad_token_id 2; engram_compressed_vocab_size 99092 (distinct normalized tokens:
  checked against the tokenizer); num_nextn_predict_layers 3, dspark_block_size 5, dspark_noise_token_id 128799,
  dspark_target_layer_ids [37,38,39], dspark_markov_rank 256, dspark_n_routed_experts 128,
  dspark_num_experts_per_tok 3 (the mtp.* DSpark draft, which the backbone never loads); dtype bfloat16;
  pad_token_id 2; bos_token_id 0; eos_token_id 1; tie_word_embeddings false (must be).
Top level (DeepseekV41Config): text_config, vision_config (num_hidden_layers 0 = text only: no vision tower and
no vision.*/aligner.*/image_* tensors; omitted, nemo builds the released 32-layer tower), image_token_id 129264.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

# The plain-torch backends (field names of nemo_automodel.components.models.common.BackendConfig).
BACKEND = {"attn": "eager", "linear": "torch", "rms_norm": "torch_fp32", "experts": "torch", "dispatcher": "torch",
           "rope": "torch", "enable_hf_state_dict_adapter": True}

# config.json's quantization_config: DeepSeek-V4's, with V4.1's 32x32 weight blocks (nemo documents the blocks, not
# V4.1's config.json; it reads only quant_method, which routes a base-checkpoint load through dequantization).
QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "scale_fmt": "ue8m0",
                       "weight_block_size": [32, 32]}

# Released values except for sizes, and swiglu_limit 2 (released 10: unit-scale activations never reach 10; 2 clamps
# 2-5% of the experts' gate and up entries). "auto": filled in by `make` (Engram rows = the sum of each layer's
# primes, compressed vocabulary = the tokenizer's).
_TINY_TEXT: dict[str, Any] = {
    "vocab_size": 512, "hidden_size": 64, "moe_intermediate_size": 32, "num_hidden_layers": 8,
    "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64,
    "o_lora_rank": 32, "o_groups": 2, "hidden_act": "silu", "swiglu_limit": 2.0, "rms_norm_eps": 1e-20,
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02, "max_position_embeddings": 1048576,
    "rope_theta": 10000.0,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2, "scoring_func": "sqrtsoftplus",
    "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
    # 0,1: window only (1: Engram); 2: ratio-2 source; 3: reuse; 4: second ratio-2 source (Engram, like the
    # released layer 14); 5: ratio-1 source and candidate source; 6: ratio-1 re-index (not a KV source, picks
    # among 5's candidates); 7: reuse of 5's entries and 6's pick.
    "compress_ratios": [0, 0, 2, 2, 2, 1, 1, 1], "compress_rope_theta": 160000.0,
    "kv_source_layer_ids": [2, 4, 5], "index_source_layer_ids": [2, 4, 5, 6],
    "index_n_heads": 8, "index_head_dim": 64, "index_topk": 16,
    "candidate_source_layer_id": 5, "candidate_topk_blocks": 8, "candidate_block_size": 8,
    "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 4], "engram_num_embeddings": "auto", "engram_max_ngram_size": 4,
    "engram_vocab_size": 256, "engram_n_heads": 8, "engram_head_dim": 32, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": "auto",
    "num_nextn_predict_layers": 0, "dspark_target_layer_ids": [], "dspark_noise_token_id": 510,
    "dtype": "bfloat16", "pad_token_id": 2, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
}

PRESETS: dict[str, dict[str, Any]] = {
    # index_topk 16 and 8 candidate blocks of 8: both stages select at a few hundred tokens (at T=300 the
    # ratio-2 layers see up to 150 entries, the ratio-1 layers up to 300 in 38 blocks).
    "tiny": {"model_type": "deepseek_v41", "architectures": ["DeepseekV41ForCausalLM"], "text_config": _TINY_TEXT,
             "vision_config": {"num_hidden_layers": 0}, "image_token_id": 511, "dtype": "bfloat16",
             "pad_token_id": 2, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False},
}
# The same model with top-k and candidate stages wide enough to keep every visible entry up to 4096 tokens.
PRESETS["tiny-dense"] = copy.deepcopy(PRESETS["tiny"])
PRESETS["tiny-dense"]["text_config"].update(index_topk=4096, candidate_topk_blocks=512)

# Released names stored quantized (nemo's state_dict_adapter.convert_single_tensor_to_hf uses the same pattern).
_QUANTIZED = re.compile(r"layers\.\d+\.(?:attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b|indexer\.wq_b)"
                        r"|ffn\.(?:shared_experts|experts\.\d+)\.w[123]|engram\.(?:embed|wkv))\.weight")
_EXPERT = re.compile(r"layers\.\d+\.ffn\.experts\.\d+\.w[123]\.weight")
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)

_SPECIALS = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"]
_IMAGE_TOKEN = "<｜image｜>"
# Text the tiny byte-level BPE is trained on: cased, spaced and accented variants of the same words, so that the
# Engram normalization (NFKC, strip accents, lowercase, collapse whitespace, strip) merges some token ids.
_CORPUS = [
    "The quick brown fox jumps over the lazy dog. THE QUICK BROWN FOX! the quick brown fox?",
    "Hello hello HELLO, world World WORLD. café Café CAFÉ naïve Naïve résumé Résumé",
    "def main():\n    return 0\n\n\tif x == 1:\n        print(x)\n",
    "Numbers 0 1 2 3 4 5 6 7 8 9 10 100 1000 and more numbers, MORE Numbers.",
    "   spaced    out   text   with   runs   of   spaces  \n\n  and newlines \n",
    "DeepSeek deepseek DEEPSEEK engram Engram ENGRAM memory Memory MEMORY",
    "Attention is sparse: a window of recent tokens, compressed entries, and the best blocks of them.",
    "Experts route tokens; the shared expert sees every token. Routing, ROUTING, routing!",
    "Über über ÜBER straße Straße façade Façade jalapeño Jalapeño coöperate",
    "{\"key\": \"value\", \"list\": [1, 2, 3], \"nested\": {\"a\": null, \"b\": true}}",
    "SELECT name, count(*) FROM users WHERE active = 1 GROUP BY name ORDER BY 2 DESC;",
    "In the beginning was the word, and the word was with the model, and the model was the word.",
]


# ---------------------------------------------------------------------------------------------
# Configuration


def load_config(spec: str) -> dict[str, Any]:
    """A preset's config.json, or a file's."""
    if spec in PRESETS:
        return copy.deepcopy(PRESETS[spec])
    with open(spec) as f:
        return json.load(f)


def _nemo_config(raw: dict[str, Any], *, dtype: str, name_or_path: str | None = None):
    """nemo's DeepseekV41Config of a config.json, its models built in `dtype`."""
    from nemo_automodel.components.models.deepseek_v41.config import DeepseekV41Config

    raw = copy.deepcopy(raw)
    raw.pop("quantization_config", None)
    raw.pop("model_type", None)
    raw.pop("transformers_version", None)
    raw["text_config"] = {**raw["text_config"], "dtype": dtype}
    raw["text_config"].pop("model_type", None)
    raw["text_config"].pop("torch_dtype", None)
    raw["dtype"] = dtype
    raw.pop("torch_dtype", None)
    config = DeepseekV41Config(**raw)
    if name_or_path is not None:
        config._name_or_path = name_or_path
    return config


def _engram_rows(text: dict[str, Any]) -> list[int]:
    """Rows of each Engram layer's table: the sum of its hash heads' primes (the released tables are that size)."""
    from nemo_automodel.components.models.deepseek_v41.engram import _next_prime

    seen: set[int] = set()
    rows = []
    for _ in text["engram_layer_ids"]:
        total = 0
        for _ in range(text["engram_max_ngram_size"] - 1):
            current = text["engram_vocab_size"] - 1
            for _ in range(text["engram_n_heads"]):
                current = _next_prime(current, seen)
                seen.add(current)
                total += current
        rows.append(total)
    return rows


# ---------------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(vocab_size: int):
    """A byte-level BPE of exactly `vocab_size` ids: the specials at 0-2 (bos, eos, pad), the image token last."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size - 1, special_tokens=_SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # A vocabulary larger than the corpus yields is filled with plain added tokens.
    tokenizer.add_tokens([f"<filler{i}>" for i in range(vocab_size - 1 - tokenizer.get_vocab_size())])
    tokenizer.add_special_tokens([_IMAGE_TOKEN])
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token=_SPECIALS[0], eos_token=_SPECIALS[1],
                                   pad_token=_SPECIALS[2])
    if len(fast) != vocab_size or fast.convert_tokens_to_ids(_IMAGE_TOKEN) != vocab_size - 1:
        raise SystemExit(f"the tiny tokenizer has {len(fast)} ids, not {vocab_size}")
    return fast


# ---------------------------------------------------------------------------------------------
# Checkpoint formats


def _pow2_ceiling(values):
    from nemo_automodel.components.models.deepseek_v41.quantization import _power_of_two_ceiling

    return _power_of_two_ceiling(values.float())


def quantize_fp8(weight, *, rowwise: bool):
    """E4M3 codes [rows, cols] and e8m0 scales: [ceil(rows/32), ceil(cols/32)] blocks, or [rows, cols/32] rows."""
    import torch
    import torch.nn.functional as F

    rows, cols = weight.shape
    row_block = 1 if rowwise else 32
    padded = F.pad(weight.float(), (0, -cols % 32, 0, -rows % row_block))
    blocks = padded.unflatten(1, (-1, 32)).unflatten(0, (-1, row_block))  # [R, rb, C, 32]
    scale = _pow2_ceiling(blocks.abs().amax(dim=(1, 3)).clamp_min(2.0**-100) / 448)
    full = scale.repeat_interleave(row_block, 0).repeat_interleave(32, 1)
    codes = (padded / full).clamp(-448, 448).to(torch.float8_e4m3fn)[:rows, :cols].contiguous()
    return codes, scale.to(torch.float8_e8m0fnu)


def quantize_fp4(weight):
    """Packed E2M1 codes int8 [rows, cols/2] (even column low nibble) and e8m0 scales [rows, cols/32]."""
    import torch

    rows, cols = weight.shape
    if cols % 32:
        raise ValueError("FP4 expert matrices need a multiple of 32 columns")
    groups = weight.float().unflatten(1, (-1, 32))
    scale = _pow2_ceiling(groups.abs().amax(-1).clamp_min(2.0**-100) / 6)
    normalized = (groups / scale.unsqueeze(-1)).clamp(-6, 6).flatten(1)
    magnitude = normalized.abs()
    midpoints = torch.tensor(_E2M1_MIDPOINTS)
    code = torch.bucketize(magnitude, midpoints)  # nearest level, a midpoint rounds down...
    tie = magnitude == midpoints[code.clamp_max(6)]
    code = code + (tie & (code % 2 == 1)).long()  # ...then up to the even code: round half to even
    code = code | ((normalized < 0) & (code > 0)).long() << 3
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed.view(torch.int8).contiguous(), scale.to(torch.float8_e8m0fnu)


def official_tensors(model, stored_dtypes: dict[str, Any], *, quantize: bool) -> dict[str, Any]:
    """The model's weights under the released names, each as the released checkpoint stores it."""
    exported = model.state_dict_adapter.to_hf(model.state_dict())
    out: dict[str, Any] = {}
    for key, value in exported.items():
        value = value.detach().contiguous()
        if not quantize:
            out[key] = value.float().clone()
        elif _EXPERT.fullmatch(key):
            out[key], out[key.removesuffix(".weight") + ".scale"] = quantize_fp4(value)
        elif _QUANTIZED.fullmatch(key):
            codes, scales = quantize_fp8(value, rowwise=".engram.embed." in key)
            out[key], out[key.removesuffix(".weight") + ".scale"] = codes, scales
        else:
            out[key] = value.to(stored_dtypes[key]).clone()
    if set(stored_dtypes) != set(exported):
        raise RuntimeError("the bfloat16 model's released names differ from the fp32 model's")
    return out


# ---------------------------------------------------------------------------------------------
# Model


def _backend():
    from nemo_automodel.components.models.common import BackendConfig

    return BackendConfig(**BACKEND)


def build_model(config, tokenizer, *, device: str = "cpu"):
    import torch
    from nemo_automodel.components.models.deepseek_v41.model import DeepseekV41ForCausalLM

    with torch.device(device):
        model = DeepseekV41ForCausalLM(config, backend=_backend(), tokenizer=tokenizer)
    return model


def oracle_init(model, seed: int) -> None:
    """Weights whose activations are O(1) everywhere, so every parameter moves the logits: projections
    N(0, 1/fan_in), embeddings N(0, 1), norm scales 1 + N(0, 0.1^2), mHC mixers of unit-scale logits, random
    attention sinks and routing biases (the image tokens' bias_vl too, which text never reads). nemo's own
    init, N(0, 0.02^2) with unit norms and zero sinks and biases, leaves most of them near their identity."""
    import torch
    from nemo_automodel.components.models.deepseek_v41.layers import DeepseekV41HyperConnection, DeepseekV41RMSNorm
    from torch import nn

    torch.manual_seed(seed)
    model.initialize_weights(buffer_device=torch.device("cpu"), dtype=torch.float32)
    generator = torch.Generator().manual_seed(seed)

    def normal_(tensor, std: float, mean: float = 0.0) -> None:
        tensor.copy_(torch.randn(tensor.shape, generator=generator, dtype=torch.float32) * std + mean)

    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Embedding):
                normal_(module.weight, 1.0)
            elif isinstance(module, nn.Linear):  # every projection, grouped wo_a and the fp32 head included
                normal_(module.weight, module.weight.shape[1] ** -0.5)
            elif isinstance(module, DeepseekV41RMSNorm):
                normal_(module.weight, 0.1, 1.0)
            elif isinstance(module, DeepseekV41HyperConnection):
                normal_(module.fn, module.fn.shape[1] ** -0.5)
                normal_(module.base, 0.5)
                normal_(module.scale, 0.1, 1.0)
        for layer in model.model.layers.values():
            normal_(layer.attn.sinks_param.weight, 1.0)
            gate = layer.ffn.gate
            normal_(gate.weight, gate.weight.shape[1] ** -0.5)
            normal_(gate.e_score_correction_bias, 0.1)
            normal_(gate.bias_vl, 0.1)  # image tokens' routing bias: text must not read it
            experts = layer.ffn.experts
            normal_(experts.gate_and_up_projs, experts.gate_and_up_projs.shape[1] ** -0.5)
            normal_(experts.down_projs, experts.down_projs.shape[1] ** -0.5)
            if layer.engram is not None:
                normal_(layer.engram.embed.weight, 1.0)
                normal_(layer.engram.q_weight, 0.1, 1.0)
                normal_(layer.engram.k_weight, 0.1, 1.0)


def stored_dtypes(config_bf16, tokenizer) -> dict[str, Any]:
    """Released name -> storage dtype of the unquantized tensors: those of nemo's bfloat16 model (meta device)."""
    model = build_model(config_bf16, tokenizer, device="meta")
    return {key: value.dtype for key, value in model.state_dict_adapter.to_hf(model.state_dict()).items()}


# ---------------------------------------------------------------------------------------------
# Commands


def cmd_make(args: argparse.Namespace) -> None:
    from nemo_automodel.components.models.deepseek_v41.engram import _compressed_token_map
    from safetensors.torch import save_file

    started = time.monotonic()
    raw = load_config(args.config)
    text = raw["text_config"]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(text["vocab_size"])
    _, compressed = _compressed_token_map(tokenizer)
    if text.get("engram_compressed_vocab_size", "auto") == "auto":
        text["engram_compressed_vocab_size"] = compressed
    if text.get("engram_num_embeddings", "auto") == "auto":
        text["engram_num_embeddings"] = _engram_rows(text)
    if args.dtype == "official":
        raw["quantization_config"] = dict(QUANTIZATION_CONFIG)
    else:
        raw.pop("quantization_config", None)
        raw["dtype"] = text["dtype"] = "float32"

    config = _nemo_config(raw, dtype="float32")
    model = build_model(config, tokenizer)
    oracle_init(model, args.seed)
    dtypes = stored_dtypes(_nemo_config(raw, dtype="bfloat16"), tokenizer)
    tensors = official_tensors(model, dtypes, quantize=args.dtype == "official")
    tensors = dict(sorted(tensors.items()))

    tokenizer.save_pretrained(out)
    with open(out / "config.json", "w") as f:
        json.dump(raw, f, indent=2)
        f.write("\n")
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(out / "model.safetensors.index.json", "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": {k: "model.safetensors" for k in tensors}}, f,
                  indent=2)
        f.write("\n")
    print(f"wrote {out}: {len(tensors)} tensors, {total} bytes, in {time.monotonic() - started:.1f} s",
          file=sys.stderr)


def load_checkpoint(ckpt: str):
    """nemo's FP32 model of DIR, loaded from its official tensors (nemo's reader and state-dict adapter)."""
    from nemo_automodel.components.checkpoint.checkpointing import (
        _maybe_adapt_state_dict_from_hf,
        load_hf_safetensors_state_dict,
    )
    from transformers import AutoTokenizer

    with open(os.path.join(ckpt, "config.json")) as f:
        raw = json.load(f)
    config = _nemo_config(raw, dtype="float32", name_or_path=ckpt)
    text = config.text_config
    tokenizer = None
    if any(i < text.num_hidden_layers for i in text.engram_layer_ids):
        tokenizer = AutoTokenizer.from_pretrained(ckpt, use_fast=True)  # as DeepseekV41Config.build_tokenizer
    model = build_model(config, tokenizer)
    expected = set(model.state_dict())
    state = _maybe_adapt_state_dict_from_hf(model, load_hf_safetensors_state_dict(ckpt))
    state = {k: v for k, v in state.items() if "_extra_state" not in k}
    missing, unexpected = expected - set(state), set(state) - expected
    if missing or unexpected:
        raise SystemExit(f"checkpoint/model mismatch: missing {sorted(missing)}, unexpected {sorted(unexpected)}")
    for key, value in state.items():
        if value.is_floating_point() and value.dtype != model.state_dict()[key].dtype:
            state[key] = value.float()
    model.load_state_dict(state, strict=True)
    model.eval()
    return model


def _topk_probe(model, log: list[dict[str, Any]], stable: bool):
    """Record, for every top-k an indexer takes, how many query rows select (see more candidates than k) and how
    many of those have a tie across the selection boundary (the k-th and (k+1)-th best scores equal: the pick is
    then the implementation's). With `stable`, such ties go to the lowest index (a stable sort), where
    torch.topk leaves the order unspecified. Returns the undo function."""
    import torch
    from nemo_automodel.components.models.deepseek_v41.attention import DeepseekV41Attention

    current: dict[str, Any] = {"layer": None, "calls": 0}
    original = torch.Tensor.topk

    def probe(self, k, dim=-1, largest=True, sorted=True):
        layer = current["layer"]
        if layer is not None and dim in (-1, self.ndim - 1) and largest and self.shape[-1]:
            stage = "top-k"
            if layer.indexer.is_candidate_source and current["calls"] == 0:
                stage = "candidate blocks"
            current["calls"] += 1
            values = self.detach().float().sort(dim=-1, descending=True).values
            width, kk = values.shape[-1], min(int(k), values.shape[-1])
            selecting = torch.isfinite(values).sum(-1) > kk
            ties = torch.zeros_like(selecting)
            if kk < width:
                ties = (values[..., kk - 1] == values[..., kk]) & torch.isfinite(values[..., kk]) & selecting
            log.append({"layer": layer.layer_idx, "stage": stage, "k": kk, "width": width,
                        "rows": int(selecting.numel()), "selecting": int(selecting.sum()),
                        "boundary_ties": int(ties.sum())})
            if stable:
                ordered = self.sort(dim=-1, descending=True, stable=True)
                return torch.return_types.topk((ordered.values[..., :k], ordered.indices[..., :k]))
        return original(self, k, dim=dim, largest=largest, sorted=sorted)

    def enter(module, inputs):
        current.update(layer=module, calls=0)

    def leave(module, inputs, output):
        current["layer"] = None

    hooks = []
    for module in model.modules():
        if isinstance(module, DeepseekV41Attention) and module.indexer is not None:
            hooks += [module.register_forward_pre_hook(enter), module.register_forward_hook(leave)]
    torch.Tensor.topk = probe

    def undo() -> None:
        torch.Tensor.topk = original
        for hook in hooks:
            hook.remove()

    return undo


def cmd_forward(args: argparse.Namespace) -> None:
    import torch

    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    # nemo torch.compiles the routed experts' clamped SwiGLU (inductor, C++ on CPU): run it as written instead,
    # so the oracle is eager PyTorch throughout and needs no compiler.
    torch.compiler.set_stance("force_eager")
    if args.no_kv_quant:
        # The window KV (FP8), compressed KV (NVFP4) and indexer query/key (MXFP4) quantize-dequantize steps are
        # all this one function, called from the attention module: make it the identity.
        from nemo_automodel.components.models.deepseek_v41 import attention

        attention.quantize_cache = lambda values, **_: values
    started = time.monotonic()
    model = load_checkpoint(args.ckpt)
    loaded = time.monotonic()
    with open(args.ids) as f:
        ids = json.load(f)
    if isinstance(ids, dict):
        ids = ids["ids"]
    input_ids = torch.tensor([ids], dtype=torch.long)
    captured: dict[str, Any] = {}
    hooks = []
    if args.hidden:
        def block_hook(index: int):
            def hook(module, inputs, output):
                streams, pre_mix, _ = output
                captured[f"layers.{index}.streams"] = streams[0].detach().float().clone()
                captured[f"layers.{index}.pre_mix"] = pre_mix[0].detach().float().clone()
            return hook

        def selection_hook(index: int):
            def hook(module, inputs, output):
                captured[f"layers.{index}.topk"] = output.state.topk_indices[0].clone()
                if module.indexer.is_candidate_source:
                    captured[f"layers.{index}.candidates"] = output.state.candidates[0].clone()
            return hook

        for index, layer in model.model.layers.items():
            hooks.append(layer.register_forward_hook(block_hook(int(index))))
            if layer.attn.indexer is not None:
                hooks.append(layer.attn.register_forward_hook(selection_hook(int(index))))
        hooks.append(model.model.norm.register_forward_hook(
            lambda module, inputs, output: captured.__setitem__("final_norm", output[0].detach().float().clone())))
        hooks.append(model.model.embed_tokens.register_forward_hook(
            lambda module, inputs, output: captured.__setitem__("embed", output[0].detach().float().clone())))
    diag: list[dict[str, Any]] = []
    undo = _topk_probe(model, diag, args.stable_topk) if args.diag or args.stable_topk else None
    try:
        with torch.inference_mode():
            output = model(input_ids)
    finally:
        if undo is not None:
            undo()
        for hook in hooks:
            hook.remove()
    logits = output.logits[0].float().contiguous()
    result: dict[str, Any] = {"logits": logits, "ids": input_ids[0]}
    result.update(captured)
    if args.diag:
        result["topk"] = diag
        for entry in diag:
            print("layer {layer} {stage}: k={k} of {width}, {selecting}/{rows} rows select, "
                  "{boundary_ties} boundary ties".format(**entry), file=sys.stderr)
    torch.save(result, args.out)
    print(f"forward T={len(ids)}: logits {tuple(logits.shape)}; load {loaded - started:.1f} s, "
          f"forward {time.monotonic() - loaded:.1f} s", file=sys.stderr)


# The formats nemo's quantize_cache applies and their group sizes: window KV, indexer queries and keys,
# compressed KV.
ROUNDINGS = {"fp8": 32, "mxfp4": 32, "nvfp4": 16}


def cmd_round(args: argparse.Namespace) -> None:
    import torch
    from nemo_automodel.components.models.deepseek_v41.quantization import quantize_cache

    values = torch.load(args.values)
    torch.save({fmt: quantize_cache(values, format=fmt, block_size=group) for fmt, group in ROUNDINGS.items()},
               args.out)


def cmd_config(args: argparse.Namespace) -> None:
    json.dump(load_config(args.name), sys.stdout, indent=2)
    sys.stdout.write("\n")


def main(argv: list[str] | None = None) -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("make", help="write a random tiny checkpoint")
    make.add_argument("--config", required=True, help=f"config.json, or a preset: {', '.join(PRESETS)}")
    make.add_argument("--out", required=True)
    make.add_argument("--seed", type=int, default=0)
    make.add_argument("--dtype", choices=["official", "fp32"], default="official")
    make.set_defaults(run=cmd_make)
    forward = commands.add_parser("forward", help="FP32 CPU logits of a checkpoint")
    forward.add_argument("--ckpt", required=True)
    forward.add_argument("--ids", required=True, help="JSON list of token ids (or {\"ids\": [...]})")
    forward.add_argument("--out", required=True)
    forward.add_argument("--hidden", action="store_true", help="also the residual streams after every block")
    forward.add_argument("--threads", type=int, default=1, help="torch threads (results are bitwise per count)")
    forward.add_argument("--diag", action="store_true", help="report (and store) how the indexers' top-k select")
    forward.add_argument("--stable-topk", action="store_true",
                         help="break exact top-k ties at the boundary lowest index first (v4serve's rule), where "
                              "torch.topk leaves them unspecified")
    forward.add_argument("--no-kv-quant", action="store_true",
                         help="skip nemo's FP8/NVFP4/MXFP4 KV and indexer quantize-dequantize (an exact comparison: "
                              "a last-bit difference can cross a rounding boundary)")
    forward.set_defaults(run=cmd_forward)
    rounding = commands.add_parser("round", help="a tensor [..., d] as each KV format reads it back")
    rounding.add_argument("--values", required=True, help="a torch.save'd FP32 tensor")
    rounding.add_argument("--out", required=True, help="a dict {fp8, mxfp4, nvfp4: tensor}")
    rounding.set_defaults(run=cmd_round)
    config = commands.add_parser("config", help="print a preset's config.json")
    config.add_argument("name", choices=sorted(PRESETS))
    config.set_defaults(run=cmd_config)
    args = parser.parse_args(argv)
    args.run(args)


if __name__ == "__main__":
    main()
