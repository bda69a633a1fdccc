"""Linear layers and experts over weights kept in checkpoint precision.

The torch twin (`kernels/quant_linear.py`) against dequantize-then-matmul with the independent
dequantizers of `engine/model/weights/quant.py`; the Triton kernels (interpreted on a CPU) against the
twin, the decoders against every code exactly, the grouped packed MoE against `moe.experts`, and
the Triton linear's batch invariance. Shapes leave partial tiles everywhere: N = 130 (128-row
blocks and column tiles), K = 260 (FP8: a 4-wide last block), K = 70 (FP4: a 6-wide last group),
T = 7 and 20 (row tiles of 16 under the interpreter).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import requires_triton
from v4serve.engine.model.plan import checkpoint_tensors, preset_config
from v4serve.engine.model.weights.quant import (
    dequant_fp4_packed,
    dequant_fp8_block,
    quantize_fp4_packed,
    quantize_fp8_block,
)
from v4serve.engine.model.weights.resident import can_stay_quantized
from v4serve.kernels import invariant, moe, quant_linear
from v4serve.kernels.quant_linear import QuantizedWeight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E8M0 = torch.float8_e8m0fnu

# fp32 activations: the kernels differ from the twin only in summation order (and, for FP8, in
# applying the block scale to the block's sum rather than to each weight).
FP32_TOL = 1e-5
# bf16 activations: the twin rounds its dequantized weight and result to bf16; the kernels keep
# fp32 until the end (and the interpreter truncates to bf16 rather than rounding): one or two bf16
# ulps, 2^-8 relative each.
BF16_TOL = 1e-2
# Experts in bf16 round twice more (the SwiGLU output is stored in bf16 between the two GEMMs).
BF16_EXPERTS_TOL = 2e-2


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()


def stored(codes: torch.Tensor, scale: torch.Tensor, fmt: str, form: str) -> QuantizedWeight:
    """The quantizer's output kept as `form` says: `float` (fp8 codes as float8_e4m3fn, scales as
    the quantizer made them: float32 or float8_e8m0fnu) or `resident` (what a loaded model holds:
    codes as bytes, e8m0 scales as bytes, fp32 scales as their int32 bits)."""
    if form == "resident":
        codes = codes.view(torch.uint8)
        scale = scale.view(torch.uint8) if scale.dtype == E8M0 else scale.view(torch.int32)
    return QuantizedWeight(codes.to(DEVICE), scale.to(DEVICE), fmt)


def quantized(n: int, k: int, fmt: str, scale_dtype: torch.dtype, form: str, gen: torch.Generator, lead: tuple = ()
              ) -> tuple[QuantizedWeight, torch.Tensor]:
    """A random weight [*lead, N, K] packed, and its dequantization by engine/model/weights/quant.py."""
    w = torch.randn(*lead, n, k, generator=gen) * k**-0.5
    if fmt == "fp8":
        codes, scale = quantize_fp8_block(w, scale_dtype=scale_dtype)
        dense = dequant_fp8_block(codes, scale)
    else:
        codes, scale = quantize_fp4_packed(w, scale_dtype=scale_dtype)
        dense = dequant_fp4_packed(codes, scale)
    return stored(codes, scale, fmt, form), dense.to(DEVICE)


SHAPES = [("fp8", 130, 260), ("fp4", 130, 70), ("fp4", 33, 256)]
SCALES = [torch.float32, E8M0]


# ---- the torch twin -------------------------------------------------------------------------------
@pytest.mark.parametrize("form", ["float", "resident"])
@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32", "e8m0"])
@pytest.mark.parametrize(("fmt", "n", "k"), SHAPES)
def test_twin_equals_dequantize_then_matmul(fmt: str, n: int, k: int, scale_dtype: torch.dtype, form: str) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w, dense = quantized(n, k, fmt, scale_dtype, form, gen)
    assert w.shape == (n, k)
    assert torch.equal(w.dequantize(), dense)  # the twin's decoding is exact, whatever the storage
    assert torch.equal(w.dequantize(rows=slice(5, 129)), dense[5:129])
    x = torch.randn(7, k, generator=gen).to(DEVICE)
    assert rel_err(quant_linear.linear(x, w), x @ dense.T) <= 1e-6


@pytest.mark.parametrize(("fmt", "n", "k", "tile"), [("fp8", 300, 260, 128), ("fp4", 130, 70, 40)])
def test_twin_tile_by_tile_equals_dequantize_then_matmul(monkeypatch, fmt: str, n: int, k: int, tile: int) -> None:
    """A tile budget of `tile` rows: several tiles, the last one partial (FP8 tiles stay whole
    128-row scale blocks)."""
    monkeypatch.setattr(quant_linear, "_TILE_ELEMENTS", tile * k)
    gen = torch.Generator().manual_seed(3)
    w, dense = quantized(n, k, fmt, E8M0, "resident", gen)
    assert quant_linear.tile_rows(w) == tile < n
    x = torch.randn(5, k, generator=gen).to(DEVICE)
    assert rel_err(quant_linear.quant_linear(x, w), x @ dense.T) <= 1e-6


def test_every_v4_projection_is_one_tile_so_packed_rounds_as_dequantized() -> None:
    """A GEMM split by output rows rounds differently from one over all of them once T is large, so
    the twin must not split any V4 weight: then `--weight-dtype checkpoint` gives bitwise the logits
    of the dequantized model (bench/bench_real_widths.py at V4-Flash's widths)."""
    for name in ("deepseek-v4-flash", "deepseek-v4-pro"):
        for tensor in checkpoint_tensors(preset_config(name)):
            if tensor.quant and can_stay_quantized(tensor.name):
                n, k = tensor.shape[-2:]
                fmt = "fp4" if tensor.quant == "fp4" else "fp8"
                codes = torch.empty(n, k // 2 if fmt == "fp4" else k, dtype=torch.uint8, device="meta")
                assert quant_linear.tile_rows(QuantizedWeight(codes, codes, fmt)) == n, tensor.name
    # V4-Flash's fused wq_a + wkv (1,536 x 4,096) under a 2,300-token prefill: bitwise the dense GEMM
    # (tiles of 1,024 + 512 rows, as the twin had, were 1.5e-4 apart).
    gen = torch.Generator().manual_seed(5)
    w, dense = quantized(1536, 4096, "fp8", E8M0, "resident", gen)
    x = torch.randn(2300, 4096, generator=gen).to(DEVICE)
    got, want = quant_linear.linear(x, w), torch.nn.functional.linear(x, dense)
    assert torch.equal(got, want) if DEVICE == "cpu" else rel_err(got, want) <= 1e-6


# ---- the Triton kernels ---------------------------------------------------------------------------
@requires_triton
@pytest.mark.parametrize(("tokens", "form"), [(7, "float"), (20, "resident")])
@pytest.mark.parametrize("scale_dtype", SCALES, ids=["fp32", "e8m0"])
@pytest.mark.parametrize(("fmt", "n", "k"), SHAPES)
def test_triton_linear_equals_its_twin(fmt: str, n: int, k: int, scale_dtype: torch.dtype, tokens: int,
                                       form: str) -> None:
    from v4serve.kernels import quant_linear_triton

    gen = torch.Generator().manual_seed(n * k + tokens)
    w, dense = quantized(n, k, fmt, scale_dtype, form, gen)
    x = torch.randn(tokens, k, generator=gen).to(DEVICE)
    want = quant_linear.linear(x, w)
    got = quant_linear_triton.linear(x, w)
    assert got.dtype == torch.float32 and got.shape == (tokens, n)
    assert rel_err(got, want) <= FP32_TOL
    assert rel_err(got, x @ dense.T) <= FP32_TOL


@requires_triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("fmt", "n", "k"), SHAPES[:2])
def test_triton_linear_in_half_precision(fmt: str, n: int, k: int, dtype: torch.dtype) -> None:
    from v4serve.kernels import quant_linear_triton

    gen = torch.Generator().manual_seed(n + 2 * k)
    w, _ = quantized(n, k, fmt, E8M0, "resident", gen)
    x = torch.randn(7, k, generator=gen).to(device=DEVICE, dtype=dtype)
    got = quant_linear_triton.linear(x, w)
    assert got.dtype == dtype
    assert rel_err(got, quant_linear.linear(x, w)) <= BF16_TOL


@requires_triton
def test_triton_linear_reads_strided_rows_and_leading_dims_and_passes_dense_weights_to_torch() -> None:
    from v4serve.kernels import quant_linear_triton

    gen = torch.Generator().manual_seed(5)
    w, dense = quantized(40, 64, "fp4", torch.float32, "float", gen)
    wide = torch.randn(6, 100, generator=gen).to(DEVICE)
    x = wide[:, 10:74]  # rows 100 apart
    assert rel_err(quant_linear_triton.linear(x, w), x @ dense.T) <= FP32_TOL
    got = quant_linear_triton.linear(x.reshape(2, 3, 64), w)
    assert got.shape == (2, 3, 40) and torch.equal(got.reshape(6, 40), quant_linear_triton.linear(x, w))
    assert quant_linear_triton.linear(x[:0], w).shape == (0, 40)
    assert torch.equal(quant_linear_triton.linear(x, dense), torch.nn.functional.linear(x, dense))


# The smallest e8m0 scale byte the exactness test uses. Byte 0 is 2^−127, an fp32 subnormal, and
# scales below 2^−117 make subnormal products: exact on a CPU, but a GPU may flush subnormals to 0.
LOWEST_SCALE_BYTE = 0 if DEVICE == "cpu" else 20


def every_code_weight(fmt: str) -> tuple[QuantizedWeight, torch.Tensor]:
    """A weight holding every finite code (FP8 [512, 16]: each byte but the NaNs 0x7F/0xFF; FP4
    [256, 64]: each byte, so every pair of nibbles), with e8m0 scales from 2^(LOWEST_SCALE_BYTE −
    127) to 2^13, and its dequantization by engine/model/weights/quant.py. K is small: x = I has K rows."""
    n, k = (512, 16) if fmt == "fp8" else (256, 64)
    index = (torch.arange(n)[:, None] * 7 + torch.arange(k)[None, :]) % 256
    low = LOWEST_SCALE_BYTE
    if fmt == "fp8":
        codes = torch.where((index & 0x7F) == 0x7F, 0, index).to(torch.uint8)
        scale = torch.tensor([[low], [127], [140], [100]], dtype=torch.uint8)
        dense = dequant_fp8_block(codes.view(torch.float8_e4m3fn), scale)
    else:
        codes = index[:, :k // 2].to(torch.uint8)
        scale = (low + torch.arange(n * 2).reshape(n, 2) * 13 % (141 - low)).to(torch.uint8)
        dense = dequant_fp4_packed(codes, scale)
    return QuantizedWeight(codes.to(DEVICE), scale.to(DEVICE), fmt), dense.to(DEVICE)


@requires_triton
@pytest.mark.parametrize("fmt", ["fp8", "fp4"])
def test_triton_decoding_is_exact_for_every_code(fmt: str) -> None:
    """x = I reads the dequantized weight back: bitwise what torch decodes, code by code."""
    from v4serve.kernels import quant_linear_triton

    w, dense = every_code_weight(fmt)
    eye = torch.eye(w.shape[1], device=DEVICE)
    assert torch.equal(quant_linear_triton.linear(eye, w), dense.T)
    assert set(w.codes.flatten().tolist()) >= set(range(256)) - {0x7F, 0xFF}


@requires_triton
@pytest.mark.parametrize(("fmt", "n", "k"), SHAPES[:2])
def test_triton_linear_is_batch_invariant(fmt: str, n: int, k: int) -> None:
    """Each row alone equals, bitwise, the same row inside a batch of 7 and of 20 (two row tiles)."""
    from v4serve.kernels import quant_linear_triton

    gen = torch.Generator().manual_seed(11)
    w, _ = quantized(n, k, fmt, torch.float32, "resident", gen)
    x = torch.randn(20, k, generator=gen).to(DEVICE)
    batch7, batch20 = quant_linear_triton.linear(x[:7], w), quant_linear_triton.linear(x, w)
    for i in [0, 3, 6]:
        alone = quant_linear_triton.linear(x[i:i + 1].clone(), w)[0]
        assert torch.equal(alone, batch7[i]) and torch.equal(alone, batch20[i])
    for i in [16, 19]:
        assert torch.equal(quant_linear_triton.linear(x[i:i + 1].clone(), w)[0], batch20[i])


@requires_triton
def test_registry_sends_packed_weights_to_triton_and_keeps_batch_invariance() -> None:
    from v4serve.kernels import quant_linear_triton
    from v4serve.kernels.registry import load_kernels

    gen = torch.Generator().manual_seed(12)
    w, dense = quantized(40, 70, "fp4", E8M0, "resident", gen)
    x = torch.randn(5, 70, generator=gen).to(DEVICE)
    kernels = load_kernels("triton", DEVICE)
    assert kernels.linear is quant_linear_triton.linear
    fast = kernels.linear(x, w)
    invariant_kernels = load_kernels("triton", DEVICE, batch_invariant=True)
    assert torch.equal(invariant_kernels.linear(x, w), fast)  # one launch, invariant already
    assert torch.equal(invariant_kernels.linear(x, dense), invariant.linear_rows(x, dense))
    for i in range(5):
        assert torch.equal(invariant_kernels.linear(x[i:i + 1].clone(), w)[0], fast[i])


# ---- grouped experts over packed stacks -----------------------------------------------------------
def packed_stacks(experts: int, inter: int, d: int, fmt: str, scale_dtype: torch.dtype, gen: torch.Generator
                  ) -> tuple[QuantizedWeight, ...]:
    w1, _ = quantized(inter, d, fmt, scale_dtype, "resident", gen, lead=(experts,))
    w2, _ = quantized(d, inter, fmt, scale_dtype, "resident", gen, lead=(experts,))
    w3, _ = quantized(inter, d, fmt, scale_dtype, "resident", gen, lead=(experts,))
    return w1, w2, w3


@requires_triton
@pytest.mark.parametrize(("fmt", "scale_dtype"), [("fp4", E8M0), ("fp8", torch.float32), ("fp8", E8M0)],
                         ids=["fp4-e8m0", "fp8-fp32", "fp8-e8m0"])
@pytest.mark.parametrize(("tokens", "d", "inter", "experts", "k", "shared"),
                         [(40, 70, 40, 5, 2, 1), (6, 130, 260, 12, 3, 0)])
def test_packed_experts_kernel_equals_its_twin(fmt: str, scale_dtype: torch.dtype, tokens: int, d: int, inter: int,
                                               experts: int, k: int, shared: int) -> None:
    """40 tokens on 5 experts: some expert's pairs span several 16-pair tiles; 6 tokens on 12
    experts: most experts unused. Widths off every tile and scale block."""
    from v4serve.kernels import moe_triton

    gen = torch.Generator().manual_seed(tokens + d + len(fmt))
    x = torch.randn(tokens, d, generator=gen).to(DEVICE)
    logits, bias = torch.randn(tokens, experts, generator=gen), torch.randn(experts, generator=gen)
    weights, chosen = moe.route(logits.to(DEVICE), bias.to(DEVICE), None, "softmax", k, 1.0, shared)
    counts = torch.bincount(chosen.flatten().cpu(), minlength=experts + shared)
    assert counts.max() > 16 or (counts == 0).any()  # ragged: a multi-tile expert or unused ones
    w1, w2, w3 = packed_stacks(experts + shared, inter, d, fmt, scale_dtype, gen)
    want = moe.experts(x, weights, chosen, w1, w2, w3, 0.8)
    got = moe_triton.experts(x, weights, chosen, w1, w2, w3, 0.8)
    assert rel_err(got, want) <= FP32_TOL
    xb = x.bfloat16()
    assert rel_err(moe_triton.experts(xb, weights, chosen, w1, w2, w3, 0.8),
                   moe.experts(xb, weights, chosen, w1, w2, w3, 0.8)) <= BF16_EXPERTS_TOL


@requires_triton
def test_experts_kernel_refuses_mixed_stacks() -> None:
    from v4serve.kernels import moe_triton

    gen = torch.Generator().manual_seed(13)
    w1, w2, w3 = packed_stacks(3, 32, 64, "fp4", E8M0, gen)
    x = torch.randn(2, 64, generator=gen).to(DEVICE)
    weights, chosen = torch.ones(2, 1, device=DEVICE), torch.zeros(2, 1, dtype=torch.long, device=DEVICE)
    with pytest.raises(TypeError, match="all be packed"):
        moe_triton.experts(x, weights, chosen, w1, torch.zeros(3, 64, 32, device=DEVICE), w3, 0.0)


# ---- the model on packed weights ------------------------------------------------------------------
def packed_small_model():
    """A 2-layer small model whose packable weights stay packed as the official checkpoints hold
    them: FP4 routed experts with e8m0 scales, FP8 elsewhere with fp32 scales (so the shared expert
    leaves the routed stack)."""
    from tests.helpers import SMALL
    from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
    from v4serve.engine.model.weights.packed import PackedFormat, pack_model
    from v4serve.engine.model.weights.resident import can_stay_quantized

    cfg = tiny_config(**{**SMALL, "num_layers": 2, "compress_ratios": (0, 4)})
    state, formats = build_tiny(cfg, seed=11).state_dict(), {}
    for name in [n for n in state if can_stay_quantized(n)]:
        fp4 = ".experts." in name
        formats[name] = PackedFormat("fp4" if fp4 else "fp8", "e8m0" if fp4 else "fp32")
        codes, scale = (quantize_fp4_packed(state[name], scale_dtype=E8M0) if fp4 else
                        quantize_fp8_block(state[name], scale_dtype=torch.float32))
        packed = stored(codes, scale, formats[name].fmt, "resident")
        state[name], state[name.removesuffix("weight") + "scale"] = packed.codes, packed.scale
    model = build_tiny(cfg, seed=0)
    pack_model(model, formats)
    model.load_state_dict(state)
    assert all(block.ffn.formats == {"w1": "fp4", "w2": "fp4", "w3": "fp4"} for block in model.layers)
    assert all(block.attn.wq_b.weight.dtype == torch.uint8 for block in model.layers)
    return model.to(DEVICE)


@requires_triton
def test_packed_model_on_triton_gives_the_torch_tokens() -> None:
    """Through the engine, two requests sharing steps: the Triton backend (and its batch-invariant
    form) on packed weights gives the torch backend's greedy tokens, logits within 1e-5."""
    from tests.helpers import engine_for, greedy, tokens
    from v4serve.kernels.registry import load_kernels

    prompts = {"a": tokens(12, 1), "b": tokens(9, 2)}

    def run(kernels):
        model = packed_small_model()
        model.use_kernels(kernels)
        engine = engine_for(model, max_num_batched_tokens=16)
        out = engine.generate([greedy(rid, p, n=2) for rid, p in prompts.items()])
        return out, {rid: torch.stack(rows) for rid, rows in engine.logits.items()}

    want, want_logits = run(load_kernels("torch"))
    for batch_invariant in (False, True):
        got, got_logits = run(load_kernels("triton", DEVICE, batch_invariant=batch_invariant))
        assert got == want
        assert all(rel_err(got_logits[r], want_logits[r]) <= FP32_TOL for r in prompts)


# ---- the grouped output projection (wo_a) -----------------------------------------------------------
# (groups, rows per group O, K): FP8 groups of whole 128-row scale blocks (a partial K block), FP8
# groups that split a block (the twin), FP4 groups with a partial 32-group.
GROUPED = [("fp8", 4, 128, 200), ("fp8", 2, 64, 128), ("fp4", 3, 40, 70)]


@pytest.mark.parametrize(("fmt", "groups", "rows", "k"), GROUPED)
def test_grouped_twin_equals_dequantize_then_einsum(fmt: str, groups: int, rows: int, k: int) -> None:
    gen = torch.Generator().manual_seed(groups * rows + k)
    w, dense = quantized(groups * rows, k, fmt, E8M0, "resident", gen)
    x = torch.randn(9, groups, k, generator=gen).to(DEVICE)
    want = torch.einsum("tgi,goi->tgo", x, dense.view(groups, rows, k))
    got = invariant.grouped_linear(x, w)
    assert got.shape == (9, groups, rows) and rel_err(got, want) <= FP32_TOL
    # Per-row (--batch-invariant) form: the same values.
    assert rel_err(invariant.grouped_linear_rows(x, w), want) <= FP32_TOL


@requires_triton
@pytest.mark.parametrize(("fmt", "groups", "rows", "k"), GROUPED)
def test_triton_grouped_linear_equals_its_twin_and_is_batch_invariant(fmt: str, groups: int, rows: int,
                                                                       k: int) -> None:
    from v4serve.kernels import quant_linear_triton

    gen = torch.Generator().manual_seed(groups * rows + k + 1)
    w, _ = quantized(groups * rows, k, fmt, torch.float32, "resident", gen)
    x = torch.randn(6, groups, k, generator=gen).to(DEVICE)
    got = quant_linear_triton.grouped_linear(x, w)
    assert rel_err(got, quant_linear.grouped_quant_linear(x, w)) <= FP32_TOL
    # --batch-invariant: a row alone equals, bitwise, the row in the batch (groups that split an FP8
    # scale block run per row through the twin).
    batched = quant_linear_triton.grouped_linear_invariant(x, w)
    alone = quant_linear_triton.grouped_linear_invariant(x[4:5].clone(), w)
    assert torch.equal(alone[0], batched[4])
