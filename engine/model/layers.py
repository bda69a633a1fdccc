"""Building blocks shared by the attention and the rest of the model: the RMSNorm module and the
rotary angles (YaRN-scaled on compressed layers); the rotation itself is `kernels.norm_rope.rope`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from v4serve.engine.model.config import YarnScaling
from v4serve.engine.model.weights.packed import weight_of
from v4serve.kernels.norm_rope import rms_norm
from v4serve.kernels.quant_linear import FP8_BLOCK, QuantizedWeight, Weight


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SharedInput:
    """Linear layers that read the same input, run as one GEMM per group of weights stacked: one
    launch instead of one per layer. `fuse` stacks them once the model is loaded and on its device:
    each layer's weight becomes a row block of its group's stack, so no memory is added and the
    state dict is unchanged. Dense weights form one group; packed ones (engine/model/weights/packed.py) one
    per format, FP8 only where every layer but the last ends on a 128-row scale block. Moving the
    model afterwards gives the layers their own tensors again; the next call notices and stacks them
    anew. Unfused, each layer runs alone."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self.layers = layers
        self.stacks: list[_Stack] | None = None

    def fuse(self) -> None:
        if self.stacks is None:
            self.stacks = [_Stack(group) for group in _groups(self.layers) if len(group) > 1]

    def __call__(self, x: torch.Tensor, linear: Callable[[torch.Tensor, Weight], torch.Tensor]
                 ) -> dict[nn.Linear, torch.Tensor]:
        """x [T, D] → each layer's output [T, O_i] (column slices of one output per stack when fused)."""
        if self.stacks is not None and any(stack.moved() for stack in self.stacks):
            self.stacks = None  # the model was moved or reloaded since: stack its weights again
            self.fuse()
        out: dict[nn.Linear, torch.Tensor] = {}
        for stack in self.stacks or []:
            out.update(stack(x, linear))
        for layer in self.layers:
            if layer not in out:
                out[layer] = linear(x, weight_of(layer))
        return out


def _groups(layers: list[nn.Linear]) -> list[list[nn.Linear]]:
    """Layers whose weights can be stacked: same format and input width; an FP8 group keeps at most
    one layer whose rows do not fill whole scale blocks, placed last."""
    by_kind: dict[tuple, list[nn.Linear]] = {}
    for layer in layers:
        fmt = getattr(layer, "packed_format", None)
        by_kind.setdefault((fmt, layer.weight.shape[-1], layer.weight.dtype), []).append(layer)
    groups = []
    for (fmt, *_), members in by_kind.items():
        if fmt is None or fmt.fmt != "fp8":
            groups.append(members)
            continue
        whole = [m for m in members if m.weight.shape[0] % FP8_BLOCK == 0]
        ragged = [m for m in members if m.weight.shape[0] % FP8_BLOCK]
        groups.append(whole + ragged[:1])
        groups.extend([m] for m in ragged[1:])
    return groups


class _Stack:
    """One group's weights concatenated by rows; each layer's tensors become views into it."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self.layers = layers
        self.rows = [layer.weight.shape[0] for layer in layers]
        self.weight = torch.cat([layer.weight.detach() for layer in layers])
        fmt = getattr(layers[0], "packed_format", None)
        self.scale = None if fmt is None else torch.cat([layer.scale for layer in layers])
        at = scale_at = 0
        for layer, rows in zip(layers, self.rows, strict=True):
            if fmt is None:
                layer.weight = nn.Parameter(self.weight[at:at + rows], requires_grad=False)
            else:
                scale_rows = layer.scale.shape[0]
                layer._buffers["weight"] = self.weight[at:at + rows]
                layer._buffers["scale"] = self.scale[scale_at:scale_at + scale_rows]
                scale_at += scale_rows
            at += rows
        self.stacked: Weight = self.weight if fmt is None else QuantizedWeight(self.weight, self.scale, fmt.fmt)

    def moved(self) -> bool:
        return self.layers[0].weight.data_ptr() != self.weight.data_ptr()

    def __call__(self, x: torch.Tensor, linear: Callable[[torch.Tensor, Weight], torch.Tensor]
                 ) -> dict[nn.Linear, torch.Tensor]:
        parts = linear(x, self.stacked).split(self.rows, dim=-1)
        return dict(zip(self.layers, parts, strict=True))


# ---- rotary embeddings ----------------------------------------------------------------------------


class Rotary:
    """Interleaved RoPE on the last r dims of a vector; YaRN-scaled frequencies when given."""

    def __init__(self, rope_dim: int, theta: float, yarn: YarnScaling | None) -> None:
        self.rope_dim = rope_dim
        self.inv_freq = self._inv_freq(rope_dim, theta, yarn)

    @staticmethod
    def _inv_freq(dim: int, base: float, yarn: YarnScaling | None) -> torch.Tensor:
        # Built on the CPU explicitly: the model may be constructed under the meta device.
        freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float, device="cpu") / dim)
        inv = 1.0 / freqs
        if yarn is None:
            return inv

        # YaRN: interpolate the slow (low-frequency) pairs by `factor`, keep the fast ones,
        # ramp linearly between; no attention-scale change (V4 applies none).
        def correction_dim(rotations: float) -> float:
            orig = yarn.original_max_position_embeddings
            return dim * math.log(orig / (rotations * 2 * math.pi)) / (2 * math.log(base))

        low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
        high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low)).clamp(0, 1)
        keep = 1 - ramp
        return (inv / yarn.factor) * (1 - keep) + inv * keep

    def place(self, device: torch.device) -> None:
        """Keep the frequencies on the model's device, copied once at load: a copy per step would be
        a host-to-device transfer (and a synchronisation) in every layer of every step."""
        self.inv_freq = self.inv_freq.to(device)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [n, r/2]
        return freqs.cos(), freqs.sin()
