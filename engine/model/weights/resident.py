"""Which weights stay in checkpoint precision once loaded (`--weight-dtype checkpoint`).

A weight stays quantized when its layer computes through `kernels.linear`, `kernels.grouped_linear`
(the grouped output projection `wo_a`) or the experts kernel, which read FP8/FP4 codes directly
(kernels/quant_linear.py). The rest of a quantized checkpoint is dequantized at load to the model
dtype, but for the parameters `held_in_fp32` names, which stay fp32 whatever the model dtype.
Plain Python, no torch: the capacity plan uses it on headers alone.
"""

from __future__ import annotations

import re

WEIGHT_DTYPES = ("auto", "checkpoint", "bf16", "fp32")

# Official names of the linear weights that may stay packed (a multi-token-prediction layer's too).
_PACKABLE = re.compile(
    r"^(?:layers|mtp)\.\d+\.(?:"
    r"e_proj|h_proj"
    r"|attn\.(?:wq_a|wq_b|wkv|wo_a|wo_b)"
    r"|attn\.(?:indexer\.)?compressor\.(?:wkv|wgate)"
    r"|attn\.indexer\.(?:wq_b|weights_proj)"
    r"|ffn\.(?:experts\.\d+|shared_experts)\.w[123]"
    r")\.weight$"
)


# Held in fp32 whatever the model dtype: what the published checkpoints store as F32 (attention
# sinks, compressor position biases `ape`, the router bias, the mHC mixing parameters), and the two
# weights whose products are computed in fp32: the router's scores and the head's logits (DeepSeek's
# reference holds its head in fp32 too). Held in bf16 instead, every step would cast them again: on
# V4-Flash at TP 1 the head alone is 1 GB read and 2 GB written per step, before its GEMM.
_HELD_IN_FP32 = re.compile(
    r"(?:^|\.)(?:hc_(?:attn|ffn|head)_(?:fn|base|scale)|attn_sink|ape|gate\.(?:weight|bias)|head\.weight)$"
)


def held_in_fp32(name: str) -> bool:
    """True for a parameter (official name, or the model's own: they agree) kept in fp32 at any
    model dtype: `head.weight`, `layers.3.ffn.gate.weight`, `layers.3.hc_attn_fn`, ..."""
    return _HELD_IN_FP32.search(name) is not None


def can_stay_quantized(name: str) -> bool:
    """True for an official weight name (`layers.3.attn.wq_b.weight`) whose layer computes from
    packed FP8/FP4 codes."""
    return _PACKABLE.match(name) is not None


def check_weight_dtype(value: str) -> None:
    if value not in WEIGHT_DTYPES:
        raise ValueError(f"--weight-dtype must be one of {', '.join(WEIGHT_DTYPES)}, got {value!r}")


def resolve_weight_dtype(weight_dtype: str, device: str) -> str:
    """What `--weight-dtype` means on `device` ("cuda", "cpu", or a torch device string such as
    "cuda:1"): "checkpoint" (quantized weights stay packed), "bf16" or "fp32" (every weight
    dequantized to that dtype). `auto` keeps checkpoint precision everywhere: on a GPU the Triton
    kernels read the packed codes, on a CPU their torch twins do (slower per token than dequantized
    weights, but the model takes what its files take; ask for bf16/fp32 to trade memory for speed)."""
    check_weight_dtype(weight_dtype)
    del device  # the same answer on every device today; callers pass it so that may change
    return "checkpoint" if weight_dtype == "auto" else weight_dtype
