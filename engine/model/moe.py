"""The mixture of experts both families share (V4 and V4.1): a router whose affinity scores choose
the experts (plus a selection-only bias), or on V4's first layers a fixed token→experts table; the
routed experts stacked with the single shared expert so one kernel runs them all.

Under tensor parallelism every expert's width is split; under expert parallelism a rank holds whole
routed experts (engine/model/parallel/sharding.py). Shapes: T = tokens, D = hidden size, E = experts.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from v4serve.engine.model.parallel.sharding import ParallelConfig, all_reduce_sum
from v4serve.engine.model.weights.packed import weight_of
from v4serve.kernels.moe import swiglu
from v4serve.kernels.quant_linear import QuantizedWeight, Weight
from v4serve.kernels.registry import Kernels, load_kernels


class ExpertsConfig(Protocol):
    """What the MoE reads of a model's configuration (V4's `ModelConfig`, V4.1's `V41Config`)."""
    @property
    def hidden_size(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def n_routed_experts(self) -> int: ...
    @property
    def n_shared_experts(self) -> int: ...
    @property
    def num_experts_per_tok(self) -> int: ...
    @property
    def moe_intermediate_size(self) -> int: ...
    @property
    def routed_scaling_factor(self) -> float: ...
    @property
    def scoring_func(self) -> str: ...
    @property
    def num_hash_layers(self) -> int: ...
    @property
    def swiglu_limit(self) -> float: ...


class Gate(nn.Module):
    """Router: affinity scores choose experts (plus a selection-only bias), or on the first
    layers a fixed token→experts table (`tid2eid`) chooses them; scores still weight them."""

    def __init__(self, cfg: ExpertsConfig, hashed: bool, image_bias: bool = False) -> None:
        """`image_bias`: V4.1's second selection bias, `bias_vl`, which image tokens route by."""
        super().__init__()
        self.topk, self.func, self.scale = cfg.num_experts_per_tok, cfg.scoring_func, cfg.routed_scaling_factor
        self.num_shared = cfg.n_shared_experts
        self.hashed = hashed
        self.kernels = load_kernels("torch")
        self.weight = nn.Parameter(torch.zeros(cfg.n_routed_experts, cfg.hidden_size))
        if hashed:
            self.register_buffer("tid2eid", torch.zeros(cfg.vocab_size, self.topk, dtype=torch.long))
        else:
            self.bias = nn.Parameter(torch.zeros(cfg.n_routed_experts))
        if image_bias:
            self.bias_vl = nn.Parameter(torch.zeros(cfg.n_routed_experts))

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, D] → (weights [T, k + S], experts [T, k + S]): routed choices, then the shared experts."""
        logits = self.kernels.linear(x.float(), self.weight.float())
        hashed = self.tid2eid[input_ids] if self.hashed else None
        bias = None if self.hashed else self.bias.float()
        return self.kernels.route(logits, bias, hashed, self.func, self.topk, self.scale, self.num_shared)


class SharedExperts(nn.Module):
    """The shared expert(s) as their own SwiGLU layers ([S·I, D] wide), when they cannot ride in
    the routed stack: more than one of them, or a checkpoint precision that differs from the
    routed experts' (FP8 shared beside FP4 routed, as the official checkpoints)."""

    def __init__(self, dim: int, width: int, limit: float) -> None:
        super().__init__()
        self.limit = limit
        self.w1 = nn.Linear(dim, width, bias=False)
        self.w2 = nn.Linear(width, dim, bias=False)
        self.w3 = nn.Linear(dim, width, bias=False)

    def forward(self, x: torch.Tensor, kernels: Kernels) -> torch.Tensor:
        """x [T, D] → [T, D] (weight 1: the shared experts see every token)."""
        up = swiglu(kernels.linear(x, weight_of(self.w1)), kernels.linear(x, weight_of(self.w3)), self.limit,
                    kernels.rowwise)
        return kernels.linear(up, weight_of(self.w2))


class MoE(nn.Module):
    """Routed experts (and, when there is exactly one, the shared expert) in one stack of weights,
    [E (+1), ...], so one kernel runs them all (kernels/moe.py). The state dict keeps the
    checkpoint's names (`experts.{e}.w1.weight`, `shared_experts.w1.weight`, ...), with `.scale`
    companions when the experts stay packed (`pack_experts`).

    Under tensor parallelism every expert's width I is split (a rank holds I/N channels of each);
    under expert parallelism a rank holds E/N whole routed experts (`first_expert` on) and the
    shared experts' I/N channels, so the shared expert leaves the stack (its width differs). The
    router is whole on every rank; the output is a partial sum, all-reduced."""

    def __init__(self, cfg: ExpertsConfig, layer: int, parallel: ParallelConfig | None = None,
                 image_bias: bool = False) -> None:
        super().__init__()
        self.gate = Gate(cfg, hashed=layer < cfg.num_hash_layers, image_bias=image_bias)
        self.kernels = load_kernels("torch")
        self.limit = cfg.swiglu_limit
        ranks = parallel.size if parallel is not None else 1
        self.split_experts = parallel is not None and parallel.splits_experts
        first, stop = parallel.span(cfg.n_routed_experts) if self.split_experts else (0, cfg.n_routed_experts)
        self.first_expert, self.num_routed = first, stop - first  # this rank's routed experts
        inter, dim = cfg.moe_intermediate_size // (1 if self.split_experts else ranks), cfg.hidden_size
        self.stacked_shared = cfg.n_shared_experts == 1 and not self.split_experts
        self.shared_experts: SharedExperts | None = None
        if cfg.n_shared_experts and not self.stacked_shared:
            width = cfg.n_shared_experts * cfg.moe_intermediate_size // ranks
            self.shared_experts = SharedExperts(dim, width, self.limit)
            self.gate.num_shared = 0
        self.reduce = all_reduce_sum if ranks > 1 else None
        n = self.num_routed + int(self.stacked_shared)
        self.formats: dict[str, str] = {}  # stacked weight → "fp8"/"fp4" once packed
        self.w1 = nn.Parameter(torch.zeros(n, inter, dim))  # gate projections
        self.w2 = nn.Parameter(torch.zeros(n, dim, inter))  # down projections
        self.w3 = nn.Parameter(torch.zeros(n, inter, dim))  # up projections
        self.register_state_dict_post_hook(_checkpoint_names)
        self.register_load_state_dict_pre_hook(_stacked_names)

    def stacked(self, name: str) -> Weight:
        """`w1`, `w2` or `w3` of every stacked expert: a tensor, or packed codes and scales."""
        if name in self.formats:
            return QuantizedWeight(getattr(self, name), getattr(self, f"{name}_scale"), self.formats[name])
        return getattr(self, name)

    def unstack_shared(self) -> None:
        """Give the single shared expert its own layers (before loading: its precision differs from
        the routed experts')."""
        if not self.stacked_shared:
            return
        device = self.w1.device
        with torch.device(device):
            self.shared_experts = SharedExperts(self.w1.shape[2], self.w1.shape[1], self.limit)
        for name in _CHANNEL_DIM:
            setattr(self, name, nn.Parameter(getattr(self, name)[:self.num_routed].detach().clone()))
        self.stacked_shared = False
        self.gate.num_shared = 0

    def forward(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, chosen = self.gate(x, input_ids)  # [T, k (+1)]
        k = self.kernels
        w1, w2, w3 = self.stacked("w1"), self.stacked("w2"), self.stacked("w3")
        if self.split_experts:
            out = k.experts(x, weights, self._on_this_rank(chosen), w1, w2, w3, self.limit, remote=True)
        else:
            out = k.experts(x, weights, chosen, w1, w2, w3, self.limit)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x, k)
        return out if self.reduce is None else self.reduce(out)  # the combine: one all-reduce

    def _on_this_rank(self, chosen: torch.Tensor) -> torch.Tensor:
        """Global expert ids [T, k] → this rank's stack indices; experts another rank holds become
        `num_routed` (one past the stack), which `kernels.experts(remote=True)` skips."""
        here = chosen - self.first_expert
        return here.masked_fill((here < 0) | (here >= self.num_routed), self.num_routed)


# Which dim of an expert weight holds its intermediate channels: rows of w1/w3, columns of w2.
_CHANNEL_DIM = {"w1": 0, "w2": 1, "w3": 0}


def _checkpoint_names(moe: MoE, state: dict[str, torch.Tensor], prefix: str, _meta: object) -> None:
    """Stacked weights → one tensor per checkpoint name (views of the stack)."""
    for w in _CHANNEL_DIM:
        for suffix, key in (("weight", w), ("scale", f"{w}_scale")):
            stack = state.pop(prefix + key, None)
            if stack is None:
                continue
            for e in range(moe.num_routed):
                state[f"{prefix}experts.{moe.first_expert + e}.{w}.{suffix}"] = stack[e]
            if moe.stacked_shared:
                state[f"{prefix}shared_experts.{w}.{suffix}"] = stack[moe.num_routed]


def _stacked_names(moe: MoE, state: dict[str, torch.Tensor], prefix: str, *_: object) -> None:
    """Checkpoint names → the stacked weights (the inverse of `_checkpoint_names`)."""
    for w in _CHANNEL_DIM:
        for suffix, key in (("weight", w), ("scale", f"{w}_scale")):
            names = [f"{prefix}experts.{moe.first_expert + e}.{w}.{suffix}" for e in range(moe.num_routed)]
            if moe.stacked_shared:
                names.append(f"{prefix}shared_experts.{w}.{suffix}")
            if any(name not in state for name in names):
                continue  # left for load_state_dict to report as missing
            state[prefix + key] = torch.stack([state.pop(name) for name in names])
