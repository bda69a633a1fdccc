"""Weights resident in checkpoint precision (`--weight-dtype checkpoint`): a linear layer's `weight`
parameter is replaced by two buffers, `weight` (the codes, as bytes) and `scale`, exactly the
official checkpoint's tensors, so the state dict keeps the checkpoint's names and the model holds
what the files hold. `weight_of(layer)` gives kernels a dense tensor or a `QuantizedWeight`.

Neither buffer is a floating-point tensor (FP8 codes are viewed as uint8, fp32 scales as int32
bits; e8m0 scales are bytes already), so casting the model can never round them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from v4serve.kernels.quant_linear import FP4_GROUP, FP8_BLOCK, QuantizedWeight, Weight


@dataclass(frozen=True)
class PackedFormat:
    fmt: str  # "fp8" (e4m3, one scale per 128×128 block) or "fp4" (e2m1 pairs, one scale per 32)
    scale: str  # "e8m0" (one byte, stored as uint8) or "fp32" (stored as int32 bits)

    def codes_shape(self, n: int, k: int) -> tuple[int, int]:
        return (n, k // 2) if self.fmt == "fp4" else (n, k)

    def scale_shape(self, n: int, k: int) -> tuple[int, int]:
        if self.fmt == "fp4":
            return n, -(-k // FP4_GROUP)
        return -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)

    @property
    def scale_dtype(self) -> torch.dtype:
        return torch.uint8 if self.scale == "e8m0" else torch.int32


def weight_of(layer: nn.Module) -> Weight:
    """The weight a kernel reads: the dense parameter, or the packed codes and scales."""
    fmt = getattr(layer, "packed_format", None)
    if fmt is None:
        return layer.weight
    return QuantizedWeight(layer.weight, layer.scale, fmt.fmt)


def pack_linear(layer: nn.Linear, fmt: PackedFormat) -> None:
    """Replace `layer.weight` [N, K] by empty codes and scale buffers of `fmt` (same device)."""
    n, k = layer.weight.shape
    device = layer.weight.device
    del layer.weight
    layer.register_buffer("weight", torch.empty(fmt.codes_shape(n, k), dtype=torch.uint8, device=device))
    layer.register_buffer("scale", torch.empty(fmt.scale_shape(n, k), dtype=fmt.scale_dtype, device=device))
    layer.packed_format = fmt


def pack_experts(moe: nn.Module, fmt: PackedFormat) -> None:
    """The same for a MoE's stacked `w1`/`w2`/`w3` [E, N, K] (scales stacked alike)."""
    for name in ("w1", "w2", "w3"):
        stack = getattr(moe, name)
        e, n, k = stack.shape
        device = stack.device
        delattr(moe, name)
        moe.register_buffer(name, torch.empty((e, *fmt.codes_shape(n, k)), dtype=torch.uint8, device=device))
        moe.register_buffer(f"{name}_scale", torch.empty((e, *fmt.scale_shape(n, k)), dtype=fmt.scale_dtype,
                                                         device=device))
        moe.formats[name] = fmt.fmt


_EXPERT = re.compile(r"^((?:layers|mtp)\.\d+\.ffn)\.experts\.\d+\.(w[123])\.weight$")
_SHARED = re.compile(r"^((?:layers|mtp)\.\d+\.ffn)\.shared_experts\.(w[123])\.weight$")


def pack_model(model: nn.Module, formats: Mapping[str, PackedFormat]) -> None:
    """Make the weights named in `formats` (official names, `layers.0.attn.wq_a.weight`) resident
    packed. Call on the meta device, before loading. A layer's routed experts are packed together
    (they must share one format); a single shared expert leaves their stack when its format differs."""
    experts: dict[str, set[PackedFormat]] = {}
    shared: dict[str, PackedFormat | None] = {}
    for name, fmt in formats.items():
        if m := _EXPERT.match(name):
            experts.setdefault(m.group(1), set()).add(fmt)
        elif m := _SHARED.match(name):
            shared[m.group(1)] = fmt
        else:
            pack_linear(model.get_submodule(name.removesuffix(".weight")), fmt)
    for prefix, found in experts.items():
        if len(found) != 1:
            raise ValueError(f"{prefix}: routed experts stored in several formats ({sorted(found, key=str)}); "
                             "load with --weight-dtype bf16 or fp32")
    for prefix in sorted(set(experts) | set(shared)):
        _pack_moe(model.get_submodule(prefix), next(iter(experts.get(prefix, {None}))), shared.get(prefix), formats,
                  prefix)


def _pack_moe(moe: nn.Module, routed: PackedFormat | None, shared: PackedFormat | None,
              formats: Mapping[str, PackedFormat], prefix: str) -> None:
    if moe.stacked_shared and routed != shared:
        moe.unstack_shared()
    if routed is not None:
        pack_experts(moe, routed)
    if moe.shared_experts is not None:
        for w in ("w1", "w2", "w3"):
            fmt = formats.get(f"{prefix}.shared_experts.{w}.weight")
            if fmt is not None:
                pack_linear(getattr(moe.shared_experts, w), fmt)


def resident_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer the model holds (packed codes and scales included)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def packed_count(model: nn.Module) -> int:
    """How many weights (a stacked expert tensor counting once) are resident packed."""
    layers = sum(getattr(m, "packed_format", None) is not None for m in model.modules())
    return layers + sum(len(getattr(m, "formats", {})) for m in model.modules())
