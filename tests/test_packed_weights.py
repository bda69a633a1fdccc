"""Weights resident in checkpoint precision: quantized tiny checkpoints (`make-checkpoint --quantize`)
load packed, hold what the files hold, and compute what the same checkpoint dequantized at load
computes — through the model and through the daemon."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import httpx
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.daemon import PATIENCE, start_daemon
from v4serve.engine.engine import kv_namespace
from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights import files as checkpoint_files
from v4serve.engine.model.weights import layout as checkpoint_layout
from v4serve.engine.model.weights import loader
from v4serve.engine.model.weights.checkpoint import load_model, quantize_checkpoint_state, write_checkpoint
from v4serve.engine.model.weights.packed import packed_count, resident_bytes, weight_of
from v4serve.engine.model.weights.resident import held_in_fp32
from v4serve.kernels.quant_linear import QuantizedWeight
from v4serve.kernels.registry import load_kernels
from v4serve.server.cli import main as cli_main
from v4serve.server.serve import ServeConfig

PROMPT = list(range(7, 7 + 150))  # crosses the CSA entries and one HCA block edge (128)
# Packed and dequantized weights hold the same values; only GEMM tiling may differ.
LOGIT_RTOL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def quantized(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The tiny model written by the CLI in each quantized layout."""
    out = {}
    for mode in ("fp8", "fp4", "mixed"):
        folder = tmp_path_factory.mktemp(mode)
        assert cli_main(["make-checkpoint", str(folder), "--quantize", mode]) == 0
        out[mode] = folder
    return out


def header_tensor_bytes(folder: Path) -> int:
    """Bytes of every stored tensor, from the safetensors headers (the files minus their headers)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            for key in handle.keys():
                sl = handle.get_slice(key)
                width = {"F32": 4, "I64": 8, "I32": 4, "BF16": 2, "F16": 2}.get(sl.get_dtype(), 1)
                total += math.prod(sl.get_shape()) * width
    return total


def logits(model: torch.nn.Module, ids: list[int] = PROMPT) -> torch.Tensor:
    model.use_kernels(load_kernels("torch"))
    return SingleSequence(model, len(ids) + 1).prefill(ids, chunk=64)


@pytest.mark.parametrize("mode", ["fp8", "fp4", "mixed"])
def test_packed_model_matches_the_checkpoint_dequantized_at_load(quantized: dict[str, Path], mode: str) -> None:
    packed = load_model(quantized[mode], packed=True, progress=False)
    dense = load_model(quantized[mode], packed=False, progress=False)
    assert packed_count(packed) > 0 and packed_count(dense) == 0
    assert rel_err(logits(packed), logits(dense)) <= LOGIT_RTOL
    # Resident bytes are the checkpoint's tensor bytes; dequantized they are far more.
    stored = header_tensor_bytes(quantized[mode])
    assert abs(resident_bytes(packed) - stored) <= 0.01 * stored
    assert resident_bytes(dense) > 1.2 * stored


def test_the_load_log_counts_weights_as_the_startup_line_does(quantized: dict[str, Path], caplog) -> None:
    """Both lines say how many weights stay in checkpoint precision, counted alike (a stacked expert
    tensor once); the load line adds how many packed tensors the files hold (one per expert)."""
    with caplog.at_level(logging.INFO, logger="v4serve.engine.model.weights.checkpoint"):
        model = load_model(quantized["fp4"], packed=True, progress=False)
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("loaded "))
    weights, tensors = map(int, re.search(r"\((\d+) weights in checkpoint precision, from (\d+) packed", line).groups())
    assert weights == packed_count(model) and tensors > weights


def test_mixed_layout_keeps_fp4_experts_and_fp8_attention(quantized: dict[str, Path]) -> None:
    model = load_model(quantized["mixed"], packed=True, progress=False)
    attn, moe = model.layers[1].attn, model.layers[1].ffn
    assert weight_of(attn.wq_a).fmt == "fp8" and weight_of(attn.wo_a).fmt == "fp8"
    assert moe.formats == {"w1": "fp4", "w2": "fp4", "w3": "fp4"}
    # The FP8 shared expert cannot ride in the FP4 stack: it has its own layers.
    assert moe.shared_experts is not None and weight_of(moe.shared_experts.w2).fmt == "fp8"
    assert moe.w1.shape[0] == model.cfg.n_routed_experts
    # The compressors, router, embedding and head were never quantized.
    assert isinstance(weight_of(attn.compressor.wkv), torch.Tensor)
    assert model.layers[1].ffn.gate.weight.dtype == torch.float32
    with safe_open(quantized["mixed"] / "model.safetensors", framework="pt") as handle:
        assert handle.get_slice("layers.1.ffn.experts.0.w1.weight").get_dtype() == "I8"
        assert handle.get_slice("layers.1.ffn.experts.0.w1.scale").get_dtype() == "F8_E8M0"
        assert handle.get_slice("layers.1.attn.wq_b.weight").get_dtype() == "F8_E4M3"
    config = json.loads((quantized["mixed"] / "config.json").read_text())
    assert config["quantization_config"]["expert_dtype"] == "fp4"


def test_a_bf16_model_holds_the_head_router_and_mhc_parameters_in_fp32(quantized: dict[str, Path]) -> None:
    """What the published checkpoints store as F32 (mHC, sinks, `ape`, the router bias) keeps its
    precision, and the head and router weight, whose products are fp32, are held so: no step casts
    them. Everything else takes the model dtype, and the bf16 model runs."""
    ref = load_model(quantized["mixed"], packed=True, progress=False)
    model = load_model(quantized["mixed"], packed=True, progress=False, dtype=torch.bfloat16)
    held = {name for name, _ in model.named_parameters() if held_in_fp32(name)}
    assert {"head.weight", "hc_head_fn", "hc_head_base", "hc_head_scale", "layers.1.hc_attn_fn", "layers.1.hc_ffn_base",
            "layers.1.ffn.gate.weight", "layers.1.ffn.gate.bias", "layers.1.attn.attn_sink",
            "layers.1.attn.compressor.ape", "layers.1.attn.indexer.compressor.ape"} <= held
    want = dict(ref.named_parameters())
    for name, param in model.named_parameters():
        if name in held:
            assert param.dtype == torch.float32 and torch.equal(param, want[name]), name
        elif param.is_floating_point():
            assert param.dtype == torch.bfloat16, name
    out = logits(model, PROMPT[:20])
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert (out.argmax(-1) == logits(ref, PROMPT[:20]).argmax(-1)).float().mean() >= 0.5


def test_packed_weights_survive_a_cast_and_a_move(quantized: dict[str, Path]) -> None:
    """Codes and scales are bytes: casting the model to bf16 (or moving it) leaves them bitwise."""
    model = load_model(quantized["mixed"], packed=True, progress=False)
    before = {k: v.clone() for k, v in model.state_dict().items() if k.endswith((".scale", "experts.0.w1.weight"))}
    model = model.to(torch.bfloat16).to("cpu")
    after = model.state_dict()
    assert all(torch.equal(after[k], v) for k, v in before.items())


def test_fp32_scales_and_transformers_names_stay_packed(tmp_path: Path) -> None:
    """transformers' spelling: `weight_scale_inv` fp32 scales and merged `gate_up_proj` experts."""
    model = build_tiny(tiny_config(moe_intermediate_size=128))
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in quantize_checkpoint_state(state, "fp8").items():
        if name.endswith(".scale"):
            renamed["model." + name.removesuffix(".scale") + ".weight_scale_inv"] = tensor.float()
        else:
            renamed["model." + name] = tensor
    layer = "model.layers.2.ffn"
    e = model.cfg.n_routed_experts
    for suffix, part in ((".weight", "gate_up_proj"), (".weight_scale_inv", "gate_up_proj_scale_inv")):
        merged = [torch.cat([renamed.pop(f"{layer}.experts.{x}.w1{suffix}"),
                             renamed.pop(f"{layer}.experts.{x}.w3{suffix}")]) for x in range(e)]
        renamed[f"model.layers.2.mlp.experts.{part}"] = torch.stack(merged)
    folder = tmp_path / "hf"
    folder.mkdir()
    save_file(renamed, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(model.cfg.to_official_dict()))
    formats = checkpoint_layout.packed_formats(folder)
    assert formats["layers.2.ffn.experts.3.w3.weight"].scale == "fp32"
    packed = load_model(folder, packed=True, progress=False)
    assert packed.layers[2].ffn.formats == {"w1": "fp8", "w2": "fp8", "w3": "fp8"}
    assert packed.layers[2].ffn.w1_scale.dtype == torch.int32  # fp32 bits
    dense = load_model(folder, packed=False, progress=False)
    assert rel_err(logits(packed), logits(dense)) <= LOGIT_RTOL


def test_the_loader_streams_one_tensor_at_a_time(quantized: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    reads = []
    original = checkpoint_files.Handles.read
    monkeypatch.setattr(checkpoint_files.Handles, "read", lambda self, entry, expert=None: (
        reads.append(entry.key), original(self, entry, expert))[1])
    model = build_tiny()
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    stream = loader.stream_checkpoint(quantized["fp4"], expected, progress=False)
    name, tensor = next(stream)
    assert len(reads) <= 2  # a weight and its scale: nothing else is read ahead
    assert sum(1 for _ in stream) + 1 == len(expected)


def test_fp8_projections_that_fill_scale_blocks_run_as_one_stacked_gemm(tmp_path: Path) -> None:
    """wq_a and wkv read the same input: packed FP8 with 128-row blocks, they stack like dense ones."""
    cfg = tiny_config(q_lora_rank=128, head_dim=128, num_heads=2, o_lora_rank=64)
    model = build_tiny(cfg)
    write_checkpoint(model, tmp_path, quantize="fp8")
    packed = load_model(tmp_path, packed=True, progress=False)
    want = logits(load_model(tmp_path, packed=False, progress=False))
    got = logits(packed)  # use_kernels stacks
    assert rel_err(got, want) <= LOGIT_RTOL
    stacks = packed.layers[1].attn.x_inputs.stacks
    fp8 = [s for s in stacks if isinstance(s.stacked, QuantizedWeight)]
    assert len(fp8) == 1 and {id(m) for m in fp8[0].layers} == {id(packed.layers[1].attn.wq_a),
                                                                  id(packed.layers[1].attn.wkv)}
    assert packed.layers[1].attn.wq_a.weight.data_ptr() == fp8[0].weight.data_ptr()


def test_weight_dtype_settings() -> None:
    cpu = torch.device("cpu")
    assert ServeConfig(weight_dtype="bf16").resolved_dtype(cpu) == torch.bfloat16
    assert ServeConfig(weight_dtype="checkpoint").resolved_dtype(cpu) == torch.float32
    with pytest.raises(ValueError, match="contradicts --dtype float32"):
        ServeConfig(weight_dtype="bf16", dtype="float32").resolved_dtype(cpu)
    with pytest.raises(ValueError, match="--weight-dtype must be one of"):
        ServeConfig(weight_dtype="int4").resolved_dtype(cpu)


def completion_tokens(url: str) -> tuple[list[str], dict]:
    body = {"model": "m", "prompt": PROMPT[:40], "max_tokens": 12, "temperature": 0, "logprobs": 1}
    out = httpx.post(f"{url}/v1/completions", json=body, timeout=PATIENCE).json()
    return out["choices"][0]["logprobs"]["tokens"], httpx.get(f"{url}/version").json()


def test_daemon_serves_a_checkpoint_packed_with_the_dequantized_tokens(quantized: dict[str, Path]) -> None:
    """The mixed checkpoint holds both packed formats (FP4 experts, FP8 elsewhere), as the official
    ones do; each format alone is compared with its dequantized model above."""
    mode, results = "mixed", {}
    for weight_dtype in ("auto", "fp32"):
        daemon = start_daemon("--model", str(quantized[mode]), "--served-model-name", "m",
                              "--weight-dtype", weight_dtype)
        try:
            results[weight_dtype] = completion_tokens(daemon.url)
        finally:
            assert daemon.stop() == 0
    (packed_tokens, packed_version), (dense_tokens, dense_version) = results["auto"], results["fp32"]
    assert packed_tokens == dense_tokens and len(packed_tokens) == 12
    assert packed_version["weight_dtype"] == "checkpoint" and dense_version["weight_dtype"] == "float32"


def test_packed_weights_get_their_own_kv_store_namespace(quantized: dict[str, Path]) -> None:
    """KV computed from packed weights may differ in the last bits from KV computed from dequantized
    ones: a store written by one is never read by the other."""
    digest = b"same files"
    names = {packed: kv_namespace(load_model(quantized["fp8"], packed=packed, progress=False), torch.float32, digest)
             for packed in (True, False)}
    assert names[True] != names[False]
