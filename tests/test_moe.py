"""The mixture-of-experts kernels: the torch twin against a per-token float64 reference written
from the definition, and the Triton kernels (interpreted on a CPU) against the twin, on shapes with
partial tiles, unused experts, experts whose tokens span several tiles, and shared experts."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.helpers import requires_triton
from v4serve.kernels import moe

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rand(*shape: int, gen: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen) * scale).to(DEVICE)


def stack(e: int, s: int, inter: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    w1, w3 = rand(e + s, inter, d, gen=gen, scale=d**-0.5), rand(e + s, inter, d, gen=gen, scale=d**-0.5)
    return w1, rand(e + s, d, inter, gen=gen, scale=inter**-0.5), w3


def reference(x, weights, chosen, w1, w2, w3, limit: float) -> torch.Tensor:
    """Σ_j weight_j · w2 (silu(clamp(w1 x)) · clamp(w3 x)), token by token, in float64."""
    out = torch.zeros(x.shape, dtype=torch.float64)
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), chosen[t].tolist(), strict=True):
            xt = x[t].double()
            gate, up = w1[e].double() @ xt, w3[e].double() @ xt
            if limit:
                gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
            out[t] += w * (w2[e].double() @ (F.silu(gate) * up))
    return out


def test_route_picks_the_top_k_and_appends_the_shared_experts() -> None:
    logits = torch.tensor([[0.0, 3.0, -1.0, 2.0], [1.0, -2.0, 0.5, 0.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.1])
    weights, chosen = moe.route(logits, bias, None, "sigmoid", 2, 2.0, 1)
    # Row 0: the bias lifts expert 3 (0.881 + 0.1) above expert 1 (0.953); best first.
    assert chosen.tolist() == [[3, 1, 4], [0, 2, 4]]
    s = logits.sigmoid()
    want = [[s[0, 3], s[0, 1]], [s[1, 0], s[1, 2]]]
    for row, (a, b) in enumerate(want):
        assert torch.allclose(weights[row, :2], torch.stack([a, b]) / (a + b) * 2.0)
    assert weights[:, 2].tolist() == [1.0, 1.0]
    hashed = torch.tensor([[2, 0], [3, 3]])
    _, chosen = moe.route(logits, bias, hashed, "softmax", 2, 1.0, 2)
    assert chosen.tolist() == [[2, 0, 4, 5], [3, 3, 4, 5]]


@pytest.mark.parametrize("limit", [0.0, 0.8])
def test_experts_twin_equals_the_definition(limit: float) -> None:
    gen = torch.Generator().manual_seed(1)
    t, d, inter, e, s, k = 9, 24, 20, 5, 1, 2
    x = rand(t, d, gen=gen)
    weights, chosen = moe.route(rand(t, e, gen=gen), rand(e, gen=gen), None, "sqrtsoftplus", k, 1.5, s)
    w1, w2, w3 = stack(e, s, inter, d, gen)
    got = moe.experts(x, weights, chosen, w1, w2, w3, limit)
    want = reference(x.cpu(), weights.cpu(), chosen.cpu(), w1.cpu(), w2.cpu(), w3.cpu(), limit)
    assert (got.cpu().double() - want).abs().max() <= 1e-5 * want.abs().max()


@requires_triton
@pytest.mark.parametrize("func", moe.SCORE_FUNCS)
@pytest.mark.parametrize(("tokens", "experts", "k", "shared"), [(1, 6, 2, 1), (33, 16, 6, 2), (5, 256, 8, 1)])
def test_route_kernel_equals_its_twin(func: str, tokens: int, experts: int, k: int, shared: int) -> None:
    from v4serve.kernels import moe_triton

    gen = torch.Generator().manual_seed(tokens + experts)
    logits, bias = rand(tokens, experts, gen=gen, scale=2.0), rand(experts, gen=gen)
    hashed = torch.randint(0, experts, (tokens, k), generator=gen).to(DEVICE)
    for given in (None, hashed):
        want = moe.route(logits, bias, given, func, k, 2.5, shared)
        got = moe_triton.route(logits, bias, given, func, k, 2.5, shared)
        assert torch.equal(got[1], want[1])
        assert torch.allclose(got[0], want[0], rtol=1e-6, atol=1e-7)
        # Interpreted, a program takes 16 tokens: a token's result must not depend on them.
        for i in (0, tokens - 1):
            alone = moe_triton.route(logits[i:i + 1], bias, None if given is None else given[i:i + 1], func, k,
                                     2.5, shared)
            assert torch.equal(alone[0][0], got[0][i]) and torch.equal(alone[1][0], got[1][i])


@requires_triton
def test_route_kernel_scores_very_negative_logits_like_torch() -> None:
    """On hash layers the experts are fixed whatever their scores: logits far below zero must
    still give softplus its tiny positive value, not 0 (every weight would then be 0)."""
    from v4serve.kernels import moe_triton

    logits = torch.tensor([[-30.0, -25.0, -8.0, -12.0, 3.0, 25.0]], device=DEVICE)
    hashed = torch.tensor([[0, 1]], device=DEVICE)
    for given in (hashed, torch.tensor([[2, 3]], device=DEVICE), None):
        want = moe.route(logits, torch.zeros(6, device=DEVICE), given, "sqrtsoftplus", 2, 1.0, 1)
        got = moe_triton.route(logits, torch.zeros(6, device=DEVICE), given, "sqrtsoftplus", 2, 1.0, 1)
        assert torch.equal(got[1], want[1])
        assert torch.allclose(got[0], want[0], rtol=1e-5, atol=0)


@requires_triton
@pytest.mark.parametrize("limit", [0.0, 0.8])
@pytest.mark.parametrize(("tokens", "d", "inter", "experts", "k", "shared"),
                         [(1, 64, 32, 6, 2, 1), (40, 72, 40, 5, 2, 1), (7, 96, 300, 12, 3, 2)])
def test_experts_kernel_equals_its_twin(limit: float, tokens: int, d: int, inter: int, experts: int, k: int,
                                        shared: int) -> None:
    """40 tokens on 5 experts: some expert gets more than one 16-pair tile; widths off the tiles."""
    from v4serve.kernels import moe_triton

    gen = torch.Generator().manual_seed(tokens * d)
    x = rand(tokens, d, gen=gen)
    weights, chosen = moe.route(rand(tokens, experts, gen=gen), rand(experts, gen=gen), None, "softmax", k, 1.0,
                                shared)
    w1, w2, w3 = stack(experts, shared, inter, d, gen)
    want = moe.experts(x, weights, chosen, w1, w2, w3, limit)
    got = moe_triton.experts(x, weights, chosen, w1, w2, w3, limit)
    assert (got - want).abs().max() <= 2e-6 * want.abs().max()


@pytest.mark.parametrize("shared", [0, 1, 2])
def test_stacked_experts_keep_the_checkpoint_names_and_round_trip(shared: int) -> None:
    """The model stacks routed and shared experts; its state dict still has one tensor per
    checkpoint name (a shared expert S·I wide as one tensor) and loads back exactly."""
    from v4serve.engine.model.v4.tiny import build_tiny, tiny_config

    cfg = tiny_config(n_shared_experts=shared)
    state = build_tiny(cfg, seed=1).state_dict()
    names = {k.split("ffn.", 1)[1] for k in state if k.startswith("layers.0.ffn.") and "gate" not in k}
    want = {f"experts.{e}.{w}.weight" for e in range(cfg.n_routed_experts) for w in ("w1", "w2", "w3")}
    want |= {f"shared_experts.{w}.weight" for w in ("w1", "w2", "w3")} if shared else set()
    assert names == want
    if shared:
        inter, dim = cfg.moe_intermediate_size, cfg.hidden_size
        assert state["layers.0.ffn.shared_experts.w1.weight"].shape == (shared * inter, dim)
        assert state["layers.0.ffn.shared_experts.w2.weight"].shape == (dim, shared * inter)
    other = build_tiny(cfg, seed=2)
    other.load_state_dict(state)
    assert all(torch.equal(a, b) for a, b in zip(other.state_dict().values(), state.values(), strict=True))


@pytest.mark.parametrize("backend", ["torch", pytest.param("triton", marks=requires_triton)])
def test_remote_choices_add_nothing(backend: str) -> None:
    """Expert parallelism: a rank's stack holds some experts; a choice equal to the stack's length
    (another rank's expert) contributes zero, so the ranks' outputs sum to the whole MoE's."""
    from v4serve.kernels import moe_triton

    run = moe.experts if backend == "torch" else moe_triton.experts
    gen = torch.Generator().manual_seed(11)
    tokens, d, inter, experts, k = 9, 64, 32, 6, 2
    x = rand(tokens, d, gen=gen)
    weights, chosen = moe.route(rand(tokens, experts, gen=gen), rand(experts, gen=gen), None, "softmax", k, 1.0, 0)
    w1, w2, w3 = stack(experts, 0, inter, d, gen)
    want = moe.experts(x, weights, chosen, w1, w2, w3, 0.0)
    halves = []
    for lo in (0, experts // 2):
        here = chosen - lo
        here = here.masked_fill((here < 0) | (here >= experts // 2), experts // 2)
        part = slice(lo, lo + experts // 2)
        halves.append(run(x, weights, here, w1[part], w2[part], w3[part], 0.0, remote=True))
    assert (halves[0] + halves[1] - want).abs().max() <= 2e-6 * want.abs().max()
