"""Building blocks shared by the attention and the rest of the model: the RMSNorm module and the
rotary angles (YaRN-scaled on compressed layers); the rotation itself is `kernels.norm_rope.rope`."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import nn

from v4serve.engine.model.config import YarnScaling
from v4serve.kernels.norm_rope import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class SharedInput:
    """Linear layers that read the same input, run as one GEMM over their weights stacked: one
    launch instead of one per layer. `fuse` stacks them once the model is loaded and on its device:
    each layer's weight becomes a row block of the stack, so no memory is added and the state dict
    is unchanged. Moving the model afterwards gives the layers their own tensors again; the next
    call notices and stacks them anew. Unfused, each layer runs alone."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        self.layers = layers
        self.stack: torch.Tensor | None = None

    def fuse(self) -> None:
        if self.stack is not None or len(self.layers) < 2:
            return
        stack = torch.cat([layer.weight.detach() for layer in self.layers])
        at = 0
        for layer in self.layers:
            rows = layer.weight.shape[0]
            layer.weight = nn.Parameter(stack[at:at + rows], requires_grad=False)
            at += rows
        self.stack = stack

    def __call__(self, x: torch.Tensor, linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
                 ) -> dict[nn.Linear, torch.Tensor]:
        """x [T, D] → each layer's output [T, O_i] (column slices of one output when fused)."""
        if self.stack is not None and self.layers[0].weight.data_ptr() != self.stack.data_ptr():
            self.stack = None  # the model was moved or reloaded since: stack its weights again
            self.fuse()
        if self.stack is None:
            return {layer: linear(x, layer.weight) for layer in self.layers}
        parts = linear(x, self.stack).split([layer.weight.shape[0] for layer in self.layers], dim=-1)
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

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq.to(positions.device)[None, :]  # [n, r/2]
        return freqs.cos(), freqs.sin()
