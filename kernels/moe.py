"""DeepSeek-V4's mixture of experts as two kernels: `route` (gate scores → each token's experts and
weights) and `experts` (the SwiGLU experts over the whole batch). Plain torch, the twin of
`moe_triton.py` (same signatures).

The shared expert rides along as expert E (E+S−1 when it is S experts wide) with weight 1: the
weights of routed and shared experts live in one stack, so one launch of `experts` runs them all.
Choices are [T, k + S]: the k routed experts in the gate's order, then the S shared ones.

Under expert parallelism a rank's stack holds only its experts, and a choice equal to the stack's
length marks a pair whose expert another rank holds (`remote=True`): it adds nothing here.

Shapes: T = tokens, D = hidden size, E = routed experts, S = shared experts, I = expert width,
k = routed experts per token, V = vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from v4serve.kernels import quant_linear

Elementwise = Callable[[Callable[[torch.Tensor], torch.Tensor], torch.Tensor], torch.Tensor]


def _batched(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    return fn(x)

SCORE_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


def scores_of(logits: torch.Tensor, func: str) -> torch.Tensor:
    if func == "softmax":
        return logits.softmax(dim=-1)
    if func == "sigmoid":
        return logits.sigmoid()
    return F.softplus(logits).sqrt()


def route(logits: torch.Tensor, bias: torch.Tensor | None, hashed: torch.Tensor | None, func: str, topk: int,
          scale: float, num_shared: int, rowwise: Elementwise = _batched) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [T, E] (fp32) → (weights [T, k + S] fp32, experts [T, k + S] int64). The routed experts
    are the top-k of scores + bias, or on hash layers the given `hashed` [T, k]; their weights are
    their scores renormalised and scaled; the shared experts get weight 1. `rowwise` applies the
    score function (`kernels/invariant.py` has a per-row form for --batch-invariant)."""
    scores = rowwise(lambda rows: scores_of(rows, func), logits)
    chosen = hashed if hashed is not None else (scores + bias).topk(topk, dim=-1).indices  # best first
    weights = scores.gather(1, chosen)
    weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * scale
    n, e = logits.shape
    shared = torch.arange(e, e + num_shared, device=logits.device).expand(n, num_shared)
    return torch.cat([weights, weights.new_ones(n, num_shared)], 1), torch.cat([chosen, shared], 1)


def swiglu(gate: torch.Tensor, up: torch.Tensor, limit: float, rowwise: Elementwise = _batched) -> torch.Tensor:
    if limit:
        gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return rowwise(F.silu, gate) * up


def experts(x: torch.Tensor, weights: torch.Tensor, chosen: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor,
            w3: torch.Tensor, limit: float, linear: Callable[..., torch.Tensor] = quant_linear.linear,
            rowwise: Elementwise = _batched, remote: bool = False) -> torch.Tensor:
    """x [T, D], weights/chosen [T, k + S], w1/w3 [E+S, I, D], w2 [E+S, D, I] → Σ_j weight_j · expert_j(x) [T, D].
    The (token, expert) pairs are sorted by expert, so each expert in use runs once on its tokens'
    rows (in token order), and each token's terms are added in expert order. `linear`/`rowwise`
    may be per-row forms (--batch-invariant): a token's result then does not depend on which other
    tokens chose the same expert. `remote`: choices equal to the stack's length are other ranks'
    experts, skipped."""
    pairs = chosen.flatten()
    order = pairs.argsort(stable=True)  # [P]: pairs grouped by expert, in token order within each
    in_use, counts = pairs[order].unique_consecutive(return_counts=True)
    in_use, counts = in_use.tolist(), counts.tolist()
    if remote and in_use and in_use[-1] == w1.shape[0]:  # other ranks' pairs sort last
        in_use.pop()
        order = order[:len(order) - counts.pop()]
    token = order // chosen.shape[1]
    rows, terms, start = x[token], [], 0
    for e, n in zip(in_use, counts, strict=True):
        mine = rows[start:start + n]
        terms.append(linear(swiglu(linear(mine, w1[e]), linear(mine, w3[e]), limit, rowwise), w2[e]))
        start += n
    out = torch.zeros_like(x)
    if terms:
        scaled = torch.cat(terms) * weights.flatten()[order, None].to(x.dtype)
        # One add per expert: a token appears once in each, so no two adds race (a single index_add_
        # over all pairs is atomic, in no fixed order, on a GPU).
        start = 0
        for n in counts:
            out.index_add_(0, token[start:start + n], scaled[start:start + n])
            start += n
    return out
