"""Which weights stay in checkpoint precision once loaded (`--weight-dtype checkpoint`).

A weight stays quantized when its layer computes through `kernels.linear`, `kernels.grouped_linear`
(the grouped output projection `wo_a`) or the experts kernel, which read FP8/FP4 codes directly
(kernels/quant_linear.py). The rest of a quantized checkpoint is dequantized at load to the model
dtype: the router `ffn.gate.weight` (run in fp32), the embedding, the head, norms and mHC
parameters. Plain Python, no torch: the capacity plan uses it on
headers alone.
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
