"""The capacity plan (`v4serve plan`, and `serve`'s check before loading): the presets' figures
against byte counts derived here from the published shapes, a header-only checkpoint folder at the
real V4-Flash shapes (sparse files: nothing large is written) against the preset, the command's
output and exit codes, and `serve` refusing a model too big before reading any tensor data."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tests.daemon import PATIENCE, ROOT
from v4serve.engine.model.plan import (
    GIB,
    PlanError,
    PlanSettings,
    check_parallel,
    checkpoint_tensors,
    plan_checkpoint,
    plan_model,
    preset_config,
)
from v4serve.engine.model.v4.tiny import build_tiny
from v4serve.engine.model.weights import files as checkpoint_files
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.engine.model.weights.quant import quantize_fp4_packed, quantize_fp8_block
from v4serve.engine.model.weights.resident import held_in_fp32, resolve_weight_dtype
from v4serve.server import model_loading
from v4serve.server.cli import main
from v4serve.server.config import ServeConfig
from v4serve.server.model_loading import check_capacity
from v4serve.server.text.tokenizer import write_byte_tokenizer_files

# The published shapes (config.json of deepseek-ai/DeepSeek-V4-Flash and -Pro).
FLASH = dict(vocab=129280, hidden=4096, layers=43, heads=64, head_dim=512, rope=64, q_lora=1024, o_groups=8,
             o_lora=1024, window=128, index_heads=64, index_dim=128, experts=256, inter=2048, topk=6, hash_layers=3,
             hc=4, ratios=[0, 0] + [4, 128] * 20 + [4], mtp=1)
PRO = dict(FLASH, hidden=7168, layers=61, heads=128, q_lora=1536, o_groups=16, experts=384, inter=3072,
           ratios=[128, 128] + [4, 128] * 29 + [4])
MODELS = {"deepseek-v4-flash": FLASH, "deepseek-v4-pro": PRO}
PARALLEL = [(1, False), (4, False), (8, False), (8, True)]


def fp8_bytes(rows: int, cols: int) -> int:
    """e4m3 codes plus one e8m0 byte per 128x128 block."""
    return rows * cols + math.ceil(rows / 128) * math.ceil(cols / 128)


def fp4_bytes(rows: int, cols: int) -> int:
    """Two e2m1 codes per byte plus one e8m0 byte per 32 values of a row."""
    return rows * cols // 2 + rows * cols // 32


def expected_per_rank(m: dict, tp: int, ep: bool) -> dict[str, int]:
    """Resident bytes of the largest rank under `--weight-dtype checkpoint` on a GPU (bf16): FP8/FP4
    linear weights as stored (wo_a included: the grouped projection reads packed rows), the head, the
    router (weight and bias), mHC parameters, sinks and `ape` at 4 bytes per parameter, every other
    float at 2, tid2eid as stored (int64). Split and replicated as the plan's rules say."""
    d, hd, heads, q, g, ol = m["hidden"], m["head_dim"], m["heads"], m["q_lora"], m["o_groups"], m["o_lora"]
    ih, idim, e, inter, bf16, f32 = m["index_heads"], m["index_dim"], m["experts"], m["inter"], 2, 4
    mix = (2 + m["hc"]) * m["hc"]
    attention = other = routed = shared = 0
    for i, ratio in enumerate(m["ratios"]):
        attention += (fp8_bytes(q, d) + fp8_bytes(heads * hd // tp, q) + fp8_bytes(hd, d)
                      + fp8_bytes(g * ol // tp, heads * hd // g) + fp8_bytes(d, g * ol // tp)
                      + heads // tp * f32 + (q + hd) * bf16)
        if ratio:
            width = (2 if ratio == 4 else 1) * hd
            attention += ratio * width * f32 + (2 * width * d + hd) * bf16
        if ratio == 4:
            attention += (fp8_bytes(ih * idim // tp, q) + ih // tp * d * bf16
                          + ratio * 2 * idim * f32 + (2 * 2 * idim * d + idim) * bf16)
        router = m["vocab"] * m["topk"] * 8 if i < m["hash_layers"] else e * f32
        other += 2 * d * bf16 + (2 * (mix * m["hc"] * d + mix + 3) + e * d) * f32 + router
        if ep:
            routed += math.ceil(e / tp) * (2 * fp4_bytes(inter, d) + fp4_bytes(d, inter))
        else:
            routed += e * (2 * fp4_bytes(inter // tp, d) + d * (inter // tp // 2 + inter // tp // 32))
        shared += 2 * fp8_bytes(inter // tp, d) + fp8_bytes(d, inter // tp)
    embedding_and_head = m["vocab"] // tp * d * (bf16 + f32)
    other += d * bf16 + (m["hc"] * m["hc"] * d + m["hc"] + 1) * f32
    out = dict(attention=attention, routed_experts=routed, shared_experts=shared,
               embedding_and_head=embedding_and_head, other=other)
    return {**out, "total": sum(out.values())}


def checkpoint_bytes(m: dict) -> int:
    """What the checkpoint stores for the tensors v4serve loads: FP8/FP4 with scales, F32 for
    attn_sink, ape, the router bias and hc_*, I64 tid2eid, BF16 for the rest."""
    d, hd, heads, q, g, ol = m["hidden"], m["head_dim"], m["heads"], m["q_lora"], m["o_groups"], m["o_lora"]
    ih, idim, e, inter = m["index_heads"], m["index_dim"], m["experts"], m["inter"]
    mix = (2 + m["hc"]) * m["hc"]
    total = 2 * m["vocab"] * d * 2 + d * 2 + (m["hc"] * m["hc"] * d + m["hc"] + 1) * 4
    for i, ratio in enumerate(m["ratios"]):
        total += (fp8_bytes(q, d) + fp8_bytes(heads * hd, q) + fp8_bytes(hd, d) + fp8_bytes(g * ol, heads * hd // g)
                  + fp8_bytes(d, g * ol) + heads * 4 + (q + hd) * 2)
        if ratio:
            width = (2 if ratio == 4 else 1) * hd
            total += ratio * width * 4 + (2 * width * d + hd) * 2
        if ratio == 4:
            total += fp8_bytes(ih * idim, q) + ih * d * 2 + ratio * 2 * idim * 4 + (2 * 2 * idim * d + idim) * 2
        total += 2 * d * 2 + 2 * (mix * m["hc"] * d + mix + 3) * 4 + e * d * 2
        total += m["vocab"] * m["topk"] * 8 if i < m["hash_layers"] else e * 4
        total += e * (3 * fp4_bytes(inter, d)) + 3 * fp8_bytes(inter, d)
    return total


def settings(**kw) -> PlanSettings:
    return PlanSettings(**{"memory_bytes": 80 * GIB, **kw})


@pytest.mark.parametrize("name", MODELS)
def test_presets_match_the_published_configs(name):
    m, cfg = MODELS[name], preset_config(name)
    assert (cfg.vocab_size, cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.head_dim, cfg.rope_dim) == \
        (m["vocab"], m["hidden"], m["layers"], m["heads"], m["head_dim"], m["rope"])
    assert (cfg.q_lora_rank, cfg.o_groups, cfg.o_lora_rank, cfg.window) == (m["q_lora"], m["o_groups"], m["o_lora"],
                                                                             m["window"])
    assert (cfg.index_n_heads, cfg.index_head_dim, cfg.n_routed_experts, cfg.n_shared_experts) == \
        (m["index_heads"], m["index_dim"], m["experts"], 1)
    assert (cfg.moe_intermediate_size, cfg.num_experts_per_tok, cfg.num_hash_layers, cfg.hc_mult) == \
        (m["inter"], m["topk"], m["hash_layers"], m["hc"])
    assert list(cfg.compress_ratios) == m["ratios"] and cfg.num_nextn_predict_layers == m["mtp"]
    assert cfg.block_size == 128 and cfg.hc_sinkhorn_iters == 20 and cfg.swiglu_limit == 10.0
    assert cfg.index_topk == (512 if name == "deepseek-v4-flash" else 1024)
    assert cfg.routed_scaling_factor == (1.5 if name == "deepseek-v4-flash" else 2.5)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("tp,ep", PARALLEL)
def test_preset_weights_per_rank_match_an_independent_count(name, tp, ep):
    plan = plan_model(name, settings(tensor_parallel_size=tp, expert_parallel=ep)).to_dict()
    assert plan["weight_bytes_per_rank"] == expected_per_rank(MODELS[name], tp, ep)
    assert plan["checkpoint_bytes"] == checkpoint_bytes(MODELS[name])
    assert plan["weight_dtype"] == "checkpoint" and plan["skipped"]["mtp_layers"] == 1


def test_presets_hold_what_the_published_checkpoints_hold():
    flash = plan_model("deepseek-v4-flash", settings()).to_dict()
    pro = plan_model("deepseek-v4-pro", settings()).to_dict()
    # With the MTP layer the plan does not count: Flash "~160 GB", Pro 805.32 GiB (its header listing).
    flash_disk = flash["checkpoint_bytes"] + flash["skipped"]["mtp_bytes"]
    pro_disk = pro["checkpoint_bytes"] + pro["skipped"]["mtp_bytes"]
    assert abs(flash_disk / 160e9 - 1) < 0.01
    assert round(pro_disk / GIB, 2) == 805.32
    assert flash["checkpoint_bytes"] == 156_015_698_140 and pro["checkpoint_bytes"] == 850_748_205_004


def test_dequantized_weights_cost_two_or_four_bytes_per_parameter():
    cfg = preset_config("deepseek-v4-flash")
    tid2eid = cfg.num_hash_layers * cfg.vocab_size * cfg.num_experts_per_tok * 8
    bf16 = plan_model("deepseek-v4-flash", settings(weight_dtype="bf16")).weights_per_rank.total
    fp32 = plan_model("deepseek-v4-flash", settings(weight_dtype="fp32")).weights_per_rank.total
    held = sum(math.prod(t.shape) for t in checkpoint_tensors(cfg) if held_in_fp32(t.name))  # fp32 in both
    assert 5e8 < held < 1e9  # the head (0.53 B) and the router and mHC parameters
    params = (bf16 - tid2eid - 4 * held) // 2 + held
    assert fp32 - tid2eid == 4 * params
    assert 280e9 < params < 290e9  # "284B parameters" with the MTP layer's ~2B
    # On a CPU, auto keeps checkpoint precision too (the torch twins read packed weights); only the
    # weights that are not packed take the CPU's fp32 compute dtype.
    on_cpu = plan_model("deepseek-v4-flash", settings(device="cpu"))
    on_gpu = plan_model("deepseek-v4-flash", settings())
    assert on_cpu.weight_dtype == "checkpoint" and on_gpu.weights_per_rank.total < on_cpu.weights_per_rank.total < bf16


def test_resolve_weight_dtype():
    assert resolve_weight_dtype("auto", "cuda") == "checkpoint"
    assert resolve_weight_dtype("auto", "cuda:1") == "checkpoint"
    assert resolve_weight_dtype("auto", "cpu") == "checkpoint"
    assert resolve_weight_dtype("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="--weight-dtype"):
        resolve_weight_dtype("int4", "cuda")


def kv_expected(m: dict, key_bytes: int, element: int = 2) -> tuple[int, int]:
    """State Cache bytes per request and Block Cache bytes per 128-token block: window ring of
    128 keys per layer; CSA keeps 8 pending rows of 2 x head_dim (kv and score) and 8 of 2 x 128 for
    the indexer, HCA 128 rows of head_dim; a block holds 32 CSA entries + 32 index keys, 1 HCA entry."""
    hd, idim = m["head_dim"], m["index_dim"]
    state = block = 0
    for ratio in m["ratios"]:
        state += m["window"] * key_bytes
        if ratio == 4:
            state += 2 * 8 * 2 * hd * element + 2 * 8 * 2 * idim * element
            block += 32 * key_bytes + 32 * idim * element
        elif ratio == 128:
            state += 2 * 128 * hd * element
            block += key_bytes
    return state, block


@pytest.mark.parametrize("name", MODELS)
def test_kv_figures(name):
    m = MODELS[name]
    for kv_dtype, key_bytes in (("auto", 512 * 2), ("fp8", 584)):  # fp8: 448 codes, 7 scales, pad, 64 bf16 rope
        plan = plan_model(name, settings(kv_cache_dtype=kv_dtype, max_model_len=1000)).to_dict()
        state, block = kv_expected(m, key_bytes)
        assert plan["state_cache_bytes_per_request"] == state
        assert plan["block_cache_bytes_per_block"] == block and plan["block_cache_bytes_per_token"] == block / 128
        assert plan["kv_bytes_per_sequence"] == state + 8 * block  # 1000 tokens: 8 blocks
        budget = plan["usable_bytes"] - plan["weight_bytes_per_rank"]["total"] - plan["activation_reserve_bytes"]
        assert plan["kv_budget_bytes"] == budget and plan["usable_bytes"] == int(80 * GIB * 0.9)
        assert plan["max_concurrent_sequences"] == max(0, budget // plan["kv_bytes_per_sequence"])
        assert plan["fits"] == (plan["max_concurrent_sequences"] >= 1)


def test_parallel_sizes_that_do_not_divide_are_refused():
    with pytest.raises(PlanError, match="attention heads"):
        plan_model("deepseek-v4-flash", settings(tensor_parallel_size=3))
    odd = dataclasses.replace(preset_config("deepseek-v4-pro"), n_routed_experts=380)
    check_parallel(odd, 8, ep=False)  # split in width, any expert count will do
    with pytest.raises(PlanError, match="routed experts \\(380\\)"):
        check_parallel(odd, 8, ep=True)
    with pytest.raises(PlanError, match="unknown preset|neither"):
        plan_model("deepseek-v5", settings())


# ---------------------------------------------------------------------------------------------
# Header-only checkpoint folders: real JSON headers, sparse data sections


def write_header_only(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> None:
    """A safetensors file whose data section is a hole: the header is real, the size is right."""
    item = {"F32": 4, "BF16": 2, "I64": 8}
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * item.get(dtype, 1)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        f.truncate(8 + len(raw) + offset)


def layer_tensors(m: dict, p: str, ratio: int, hashed: bool, fp4_scale: str) -> dict[str, tuple[str, list[int]]]:
    """One block as the published checkpoints store it (official names)."""
    d, hd, heads, q, g, ol = m["hidden"], m["head_dim"], m["heads"], m["q_lora"], m["o_groups"], m["o_lora"]
    mix, hc, e, inter = (2 + m["hc"]) * m["hc"], m["hc"], m["experts"], m["inter"]
    t: dict[str, tuple[str, list[int]]] = {}

    def fp8(name: str, rows: int, cols: int) -> None:
        t[name + ".weight"] = ("F8_E4M3", [rows, cols])
        t[name + ".scale"] = ("F8_E8M0", [math.ceil(rows / 128), math.ceil(cols / 128)])

    for part in ("attn", "ffn"):
        t |= {f"{p}hc_{part}_fn": ("F32", [mix, hc * d]), f"{p}hc_{part}_base": ("F32", [mix]),
              f"{p}hc_{part}_scale": ("F32", [3]), f"{p}{part}_norm.weight": ("BF16", [d])}
    a = p + "attn."
    t |= {a + "attn_sink": ("F32", [heads]), a + "q_norm.weight": ("BF16", [q]), a + "kv_norm.weight": ("BF16", [hd])}
    fp8(a + "wq_a", q, d), fp8(a + "wq_b", heads * hd, q), fp8(a + "wkv", hd, d)
    fp8(a + "wo_a", g * ol, heads * hd // g), fp8(a + "wo_b", d, g * ol)
    for prefix, width, present in ((a + "compressor.", hd, ratio), (a + "indexer.compressor.", 128, ratio == 4)):
        if present:
            out = (2 if ratio == 4 else 1) * width
            t |= {prefix + "ape": ("F32", [ratio, out]), prefix + "wkv.weight": ("BF16", [out, d]),
                  prefix + "wgate.weight": ("BF16", [out, d]), prefix + "norm.weight": ("BF16", [width])}
    if ratio == 4:
        fp8(a + "indexer.wq_b", m["index_heads"] * m["index_dim"], q)
        t[a + "indexer.weights_proj.weight"] = ("BF16", [m["index_heads"], d])
    f = p + "ffn."
    t[f + "gate.weight"] = ("BF16", [e, d])
    t |= {f + "gate.tid2eid": ("I64", [m["vocab"], m["topk"]])} if hashed else {f + "gate.bias": ("F32", [e])}
    for x in range(e):
        for w, (rows, cols) in (("w1", (inter, d)), ("w2", (d, inter)), ("w3", (inter, d))):
            t[f"{f}experts.{x}.{w}.weight"] = ("I8", [rows, cols // 2])
            t[f"{f}experts.{x}.{w}.scale"] = (fp4_scale, [rows, cols // 32])
    fp8(f + "shared_experts.w1", inter, d), fp8(f + "shared_experts.w2", d, inter)
    fp8(f + "shared_experts.w3", inter, d)
    return t


def write_real_shape_folder(folder: Path, m: dict, config: dict) -> Path:
    """config.json + one header-only shard per block (as the published ones) + the index, MTP included."""
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    d, hc = m["hidden"], m["hc"]
    shards = {"embed": {"embed.weight": ("BF16", [m["vocab"], d])},
              "head": {"head.weight": ("BF16", [m["vocab"], d]), "norm.weight": ("BF16", [d]),
                       "hc_head_fn": ("F32", [hc, hc * d]), "hc_head_base": ("F32", [hc]),
                       "hc_head_scale": ("F32", [1])}}
    for i, ratio in enumerate(m["ratios"]):
        scale = "U8" if i % 2 else "F8_E8M0"  # some writers keep e8m0 scales as raw bytes
        shards[f"layer{i}"] = layer_tensors(m, f"layers.{i}.", ratio, i < m["hash_layers"], scale)
    mtp = layer_tensors(m, "mtp.0.", 0, False, "F8_E8M0")
    for name in ("e_proj", "h_proj"):
        mtp |= {f"mtp.0.{name}.weight": ("F8_E4M3", [d, d]), f"mtp.0.{name}.scale": ("F8_E8M0", [d // 128, d // 128])}
    mtp |= {f"mtp.0.{n}.weight": ("BF16", [d]) for n in ("enorm", "hnorm", "norm")}
    mtp |= {"mtp.0.hc_head_fn": ("F32", [hc, hc * d]), "mtp.0.hc_head_base": ("F32", [hc]),
            "mtp.0.hc_head_scale": ("F32", [1])}
    shards["mtp"] = mtp
    weight_map = {}
    for n, tensors in enumerate(shards.values()):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        write_header_only(folder / name, tensors)
        weight_map |= dict.fromkeys(tensors, name)
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return folder


def data_bytes(folder: Path) -> int:
    """Bytes of every data section (file size less the 8-byte length and the JSON header)."""
    total = 0
    for file in folder.glob("*.safetensors"):
        with open(file, "rb") as f:
            total += file.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    return total


@pytest.fixture(scope="module")
def flash_folder(tmp_path_factory) -> Path:
    from v4serve.engine.model.plan import DEEPSEEK_V4_FLASH

    return write_real_shape_folder(tmp_path_factory.mktemp("plan") / "DeepSeek-V4-Flash", FLASH, DEEPSEEK_V4_FLASH)


def test_header_only_files_are_valid_safetensors(flash_folder):
    shard = flash_folder / "model-00003-of-00046.safetensors"  # layers.0 (after embed and head)
    assert shard.stat().st_size > 3e9 and shard.stat().st_blocks * 512 < 1e7  # sparse: no data written
    with safe_open(shard, framework="pt") as f:
        wq_b = f.get_slice("layers.0.attn.wq_b.weight")
        assert (wq_b.get_dtype(), wq_b.get_shape()) == ("F8_E4M3", [32768, 1024])
        scale = f.get_slice("layers.0.ffn.experts.7.w2.scale")
        assert (scale.get_dtype(), scale.get_shape()) == ("F8_E8M0", [4096, 64])


@pytest.mark.parametrize("tp,ep", [(1, False), (8, True)])
def test_real_shape_folder_plans_as_the_preset(flash_folder, tp, ep):
    common = settings(tensor_parallel_size=tp, expert_parallel=ep)
    folder = plan_checkpoint(flash_folder, common).to_dict()
    preset = plan_model("deepseek-v4-flash", common).to_dict()
    for key in ("model", "source"):
        folder.pop(key), preset.pop(key)
    assert folder == preset
    assert folder["skipped"]["mtp_tensors"] == 1575
    assert folder["checkpoint_bytes"] + folder["skipped"]["mtp_bytes"] == data_bytes(flash_folder)


def test_checkpoint_bytes_of_a_quantized_tiny_checkpoint(tmp_path):
    """Partial 128x128 tiles, fp32 FP8 scales, e8m0 FP4 scales: the plan counts the files' bytes."""
    tensors = {k: v.contiguous() for k, v in build_tiny().state_dict().items()}
    for name in list(tensors):
        if name.endswith((".wq_a.weight", ".wq_b.weight", ".wkv.weight", ".wo_a.weight", ".wo_b.weight")) \
                or ".shared_experts." in name:
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_fp8_block(tensors[name])
        elif ".ffn.experts." in name:
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = quantize_fp4_packed(
                tensors[name], scale_dtype=torch.float8_e8m0fnu)
    folder = tmp_path / "tiny-fp8"
    write_checkpoint(build_tiny(), folder)
    (folder / "model.safetensors").unlink()
    save_file(tensors, folder / "model.safetensors")
    plan = plan_checkpoint(folder, settings())
    assert plan.checkpoint_bytes == data_bytes(folder) == sum(t.numel() * t.element_size() for t in tensors.values())
    dequantized = plan_checkpoint(folder, settings(weight_dtype="bf16")).weights_per_rank
    assert plan.weights_per_rank.routed_experts < dequantized.routed_experts / 3  # FP4 + scales vs bf16


def test_plan_command_table_json_and_exit_codes(flash_folder, capsys):
    assert main(["plan", "--model", "deepseek-v4-flash", "--tensor-parallel-size", "4", "--gpu-memory", "80"]) == 0
    table = capsys.readouterr().out
    for line in ("routed experts", "State Cache per request", "Block Cache per token", "Max concurrent sequences",
                 "Fits: yes"):
        assert line in table
    assert main(["plan", "--model", str(flash_folder), "--gpu-memory", "141", "--json"]) == 1  # one H200: no
    plan = json.loads(capsys.readouterr().out)
    assert plan["fits"] is False and plan["max_concurrent_sequences"] == 0
    assert set(plan["weight_bytes_per_rank"]) == {"attention", "routed_experts", "shared_experts",
                                                  "embedding_and_head", "other", "total"}
    for bad in (["--tensor-parallel-size", "3", "--gpu-memory", "80"], ["--gpu-memory", "0"],
                ["--gpu-memory", "80", "--kv-cache-dtype", "fp4"]):
        assert main(["plan", "--model", "deepseek-v4-pro", *bad]) == 2
        assert "v4serve plan:" in capsys.readouterr().err
    assert main(["plan", "--model", str(flash_folder / "missing"), "--gpu-memory", "80"]) == 2
    # A missing folder is named as such, before any question of memory; --device cpu plans in this
    # machine's memory, as serve measures it there.
    assert main(["plan", "--model", str(flash_folder / "missing")]) == 2
    err = capsys.readouterr().err
    assert "missing is neither" in err and "CUDA" not in err and "gpu-memory" not in err
    assert main(["plan", "--model", "deepseek-v4-pro", "--device", "cpu", "--json"]) == 1  # 1.6T parameters: no
    host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert json.loads(capsys.readouterr().out)["gpu_memory_bytes"] == host


def test_plan_command_as_a_process():
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "plan", "--model", "deepseek-v4-pro",
                           "--tensor-parallel-size", "8", "--gpu-memory", "141", "--json"],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["fits"] is True


# ---------------------------------------------------------------------------------------------
# serve checks the plan before loading


def test_serve_refuses_a_model_too_big_before_reading_weights(flash_folder, monkeypatch):
    def no_reading(*_args, **_kwargs):
        raise AssertionError("tensor data was read")

    monkeypatch.setattr(checkpoint_files.Handles, "read", no_reading)
    monkeypatch.setattr(model_loading, "load_model", no_reading)
    with pytest.raises(ValueError, match="does not fit") as err:
        model_loading.load_ranks(ServeConfig(model=str(flash_folder), device="cpu"))
    assert "Capacity plan: DeepSeek-V4-Flash" in str(err.value) and "Fits: no" in str(err.value)


def test_serve_exits_with_the_table_in_seconds(flash_folder):
    """The plan is made in the engine process; its refusal still ends the daemon (status 2) with the
    table, before anything is served."""
    write_byte_tokenizer_files(flash_folder)  # a real checkpoint folder has one; the front end loads it first
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--model", str(flash_folder),
                           "--device", "cpu", "--no-kv-store", "--port", "0"], cwd=ROOT, capture_output=True,
                          text=True, timeout=PATIENCE)
    assert done.returncode == 2
    assert "does not fit" in done.stderr and "routed experts" in done.stderr and "Fits: no" in done.stderr
    # Refused from the headers: no tensor was read (a load reports every shard it reads, and reading
    # 156 GB would take minutes even where it fit).
    assert "shard" not in done.stderr


def test_serve_logs_the_plan_of_a_model_that_fits(tmp_path, caplog):
    folder = write_checkpoint(build_tiny(), tmp_path / "tiny")
    with caplog.at_level(logging.INFO, logger="v4serve"):
        check_capacity(ServeConfig(model=str(folder)), folder, torch.device("cpu"), torch.float32)
    assert "Capacity plan: tiny" in caplog.text and "Fits: yes" in caplog.text
