"""Checkpoint loading: the three naming variants, sharding, quantized weights and every error path.

The oracle for the name mapping is transformers itself: a checkpoint written with official names is
loaded by `DeepseekV4ForCausalLM.from_pretrained` (which applies transformers' own renaming), and
what that model holds in memory or writes with `save_pretrained` must load back into exactly the
official tensors we started from.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from v4serve.engine.model.weights import loader
from v4serve.engine.model.weights.files import CheckpointError, read_config_json
from v4serve.engine.model.weights.layout import official_name
from v4serve.engine.model.weights.loader import load_checkpoint
from v4serve.engine.model.weights.quant import FP4_E2M1_VALUES, quantize_fp4_packed, quantize_fp8_block

transformers = pytest.importorskip("transformers")

LAYER_TYPES = [
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
    "sliding_attention",
]
TINY = dict(
    vocab_size=96,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    n_routed_experts=4,
    num_experts_per_tok=2,
    layer_types=LAYER_TYPES,
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    mlp_layer_types=["hash_moe", "moe", "moe", "moe"],
    sliding_window=8,
    o_groups=2,
    o_lora_rank=16,
    index_n_heads=2,
    index_head_dim=16,
    index_topk=4,
    hc_mult=2,
    partial_rotary_factor=0.25,
)
F32 = torch.float32
Spec = dict[str, tuple[tuple[int, ...], torch.dtype]]


def official_spec(c: dict) -> Spec:
    """Official tensor names and shapes, written out from DeepSeek-V4's module layout."""
    d, v, hc, h, hd, q = (
        c[k] for k in ("hidden_size", "vocab_size", "hc_mult", "num_attention_heads", "head_dim", "q_lora_rank")
    )
    e, inter, og, olr = c["n_routed_experts"], c["moe_intermediate_size"], c["o_groups"], c["o_lora_rank"]
    ih, ihd, mix = c["index_n_heads"], c["index_head_dim"], (2 + hc) * hc
    spec: Spec = {
        "embed.weight": ((v, d), F32),
        "norm.weight": ((d,), F32),
        "head.weight": ((v, d), F32),
        "hc_head_fn": ((hc, hc * d), F32),
        "hc_head_base": ((hc,), F32),
        "hc_head_scale": ((1,), F32),
    }
    for i, kind in enumerate(c["layer_types"]):
        p = f"layers.{i}."
        layer = {
            "attn_norm.weight": (d,), "ffn_norm.weight": (d,),
            "hc_attn_fn": (mix, hc * d), "hc_attn_base": (mix,), "hc_attn_scale": (3,),
            "hc_ffn_fn": (mix, hc * d), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
            "attn.wq_a.weight": (q, d), "attn.q_norm.weight": (q,), "attn.wq_b.weight": (h * hd, q),
            "attn.wkv.weight": (hd, d), "attn.kv_norm.weight": (hd,), "attn.wo_a.weight": (og * olr, h * hd // og),
            "attn.wo_b.weight": (d, og * olr), "attn.attn_sink": (h,), "ffn.gate.weight": (e, d),
            "ffn.shared_experts.w1.weight": (inter, d), "ffn.shared_experts.w2.weight": (d, inter),
            "ffn.shared_experts.w3.weight": (inter, d),
        }  # fmt: skip
        if kind != "sliding_attention":
            ratio, width = c["compress_rates"][kind], (2 if kind == "compressed_sparse_attention" else 1) * hd
            layer |= {
                "attn.compressor.wkv.weight": (width, d),
                "attn.compressor.wgate.weight": (width, d),
                "attn.compressor.ape": (ratio, width),
                "attn.compressor.norm.weight": (hd,),
            }
        if kind == "compressed_sparse_attention":
            layer |= {
                "attn.indexer.wq_b.weight": (ih * ihd, q),
                "attn.indexer.weights_proj.weight": (ih, d),
                "attn.indexer.compressor.wkv.weight": (2 * ihd, d),
                "attn.indexer.compressor.wgate.weight": (2 * ihd, d),
                "attn.indexer.compressor.ape": (ratio, 2 * ihd),
                "attn.indexer.compressor.norm.weight": (ihd,),
            }
        for x in range(e):
            layer |= {
                f"ffn.experts.{x}.w1.weight": (inter, d),
                f"ffn.experts.{x}.w2.weight": (d, inter),
                f"ffn.experts.{x}.w3.weight": (inter, d),
            }
        spec |= {p + k: (shape, F32) for k, shape in layer.items()}
        if c["mlp_layer_types"][i] == "hash_moe":
            spec[p + "ffn.gate.tid2eid"] = ((v, c["num_experts_per_tok"]), torch.int64)
        else:
            spec[p + "ffn.gate.bias"] = ((e,), F32)
    return spec


def random_tensors(spec: Spec, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, dtype) in spec.items():
        if dtype.is_floating_point:
            out[name] = torch.randn(shape, generator=gen)
        else:  # official checkpoints may store tid2eid narrower than int64
            out[name] = torch.randint(0, TINY["n_routed_experts"], shape, generator=gen, dtype=torch.int32)
    return out


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], spec: Spec) -> None:
    assert list(got) == list(spec)
    for name, tensor in got.items():
        assert tensor.dtype == spec[name][1], name
        assert tensor.shape == spec[name][0], name
        assert torch.equal(tensor, want[name].to(tensor.dtype)), name


@pytest.fixture(scope="module")
def spec() -> Spec:
    return official_spec(TINY)


@pytest.fixture(scope="module")
def official(spec: Spec) -> dict[str, torch.Tensor]:
    return random_tensors(spec)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory, official: dict[str, torch.Tensor]) -> dict[str, Path]:
    """The same weights in every layout: official, transformers in-memory, save_pretrained (+ sharded)."""
    root = tmp_path_factory.mktemp("ckpt")
    config = transformers.DeepseekV4Config(**TINY)
    dirs = {name: root / name for name in ("official", "memory", "saved", "sharded")}
    mtp = {"mtp.0.attn.wq_a.weight": torch.randn(4, 4), "mtp.0.emb.tok_emb.weight": torch.randn(4, 4)}
    dirs["official"].mkdir()
    save_file({**official, **mtp}, dirs["official"] / "model.safetensors")
    config.save_pretrained(dirs["official"])
    model, info = transformers.DeepseekV4ForCausalLM.from_pretrained(dirs["official"], output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"]
    dirs["memory"].mkdir()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, dirs["memory"] / "model.safetensors")
    model.save_pretrained(dirs["saved"])
    model.save_pretrained(dirs["sharded"], max_shard_size="60KB")
    return dirs


def test_transformers_layouts_are_what_the_loader_expects(folders: dict[str, Path]) -> None:
    from safetensors import safe_open

    def keys(folder: str) -> set[str]:
        with safe_open(folders[folder] / "model.safetensors", "pt") as f:
            return set(f.keys())

    saved, memory = keys("saved"), keys("memory")
    # save_pretrained: official names under `model.`, with these exceptions.
    assert {"head.weight", "model.embed_tokens.weight", "model.hc_head.hc_fn", "model.norm.weight",
            "model.layers.0.attn.norm.weight", "model.layers.1.attn.compressor.norm.weight",
            "model.layers.1.ffn.experts.3.w2.weight"} <= saved  # fmt: skip
    assert not any(k.startswith(("mtp.", "model.mtp.")) for k in saved)
    assert {"lm_head.weight", "model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.self_attn.sinks",
            "model.layers.1.self_attn.compressor.indexer.scorer.weights_proj.weight"} <= memory  # fmt: skip
    assert len(list(folders["sharded"].glob("*.safetensors"))) > 2


@pytest.mark.parametrize("variant", ["official", "memory", "saved", "sharded"])
def test_every_layout_loads_the_official_tensors(
    variant: str, folders: dict[str, Path], official: dict[str, torch.Tensor], spec: Spec, tmp_path: Path
) -> None:
    got = load_checkpoint(folders[variant], spec, progress=False)
    assert_same(got, official, spec)
    save_file(got, tmp_path / "resaved.safetensors")  # no two results share storage


def test_dtype_cast_and_int64_buffers(folders: dict[str, Path], official: dict[str, torch.Tensor], spec: Spec) -> None:
    got = load_checkpoint(folders["official"], spec, dtype=torch.bfloat16, progress=False)
    assert got["layers.0.attn.wq_a.weight"].dtype == torch.bfloat16
    assert torch.equal(got["embed.weight"], official["embed.weight"].bfloat16())
    assert got["layers.0.ffn.gate.tid2eid"].dtype == torch.int64
    assert torch.equal(got["layers.0.ffn.gate.tid2eid"], official["layers.0.ffn.gate.tid2eid"].long())


def test_official_name_mapping() -> None:
    cases = {
        "model.embed_tokens.weight": "embed.weight",
        "lm_head.weight": "head.weight",
        "head.weight": "head.weight",
        "model.hc_head.hc_scale": "hc_head_scale",
        "model.layers.7.attn.norm.weight": "layers.7.attn.kv_norm.weight",
        "model.layers.7.attn.compressor.norm.weight": "layers.7.attn.compressor.norm.weight",
        "model.layers.2.self_attn.compressor.indexer.kv_norm.weight": "layers.2.attn.indexer.compressor.norm.weight",
        "model.layers.2.self_attn.compressor.indexer.position_bias": "layers.2.attn.indexer.compressor.ape",
        "model.layers.2.self_attn.compressor.indexer.q_b_proj.weight": "layers.2.attn.indexer.wq_b.weight",
        "model.layers.2.self_attn.compressor.kv_norm.weight": "layers.2.attn.compressor.norm.weight",
        "model.layers.2.self_attn.kv_norm.weight": "layers.2.attn.kv_norm.weight",
        "model.layers.2.attn_hc.scale": "layers.2.hc_attn_scale",
        "model.layers.2.mlp.gate.e_score_correction_bias": "layers.2.ffn.gate.bias",
        "model.layers.2.mlp.shared_experts.up_proj.weight": "layers.2.ffn.shared_experts.w3.weight",
        "layers.2.ffn.experts.5.w2.weight": "layers.2.ffn.experts.5.w2.weight",
        "mtp.0.attn.wq_a.weight": "mtp.0.attn.wq_a.weight",
    }
    assert {k: official_name(k) for k in cases} == cases


# --- quantized checkpoints -----------------------------------------------------------------------

FP8_NAMES = ("attn.wq_a.weight", "attn.wq_b.weight", "attn.wkv.weight", "attn.wo_b.weight",
             "ffn.shared_experts.w1.weight", "ffn.shared_experts.w2.weight")  # fmt: skip


def ref_fp8(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Plain reference: every element times the scale of its 128x128 tile."""
    n, k = q.shape[-2:]
    full = s.float().repeat_interleave(128, -2)[..., :n, :].repeat_interleave(128, -1)[..., :k]
    return q.float() * full


def ref_fp4(packed: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Plain reference: element 2j is byte j's low nibble, 2j+1 its high nibble; scale per 32."""
    table = torch.tensor(FP4_E2M1_VALUES)
    b = packed.view(torch.uint8).long()
    vals = torch.stack((table[b % 16], table[b // 16]), -1).flatten(-2)
    return vals * s.float().repeat_interleave(32, -1)[..., : vals.shape[-1]]


def test_official_fp8_and_fp4_checkpoint(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    tensors, want = dict(official), dict(official)
    for name in list(official):
        if name.endswith(FP8_NAMES):
            q, s = quantize_fp8_block(official[name], scale_dtype=torch.float8_e8m0fnu)
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = q, s
            want[name] = ref_fp8(q, s)
        elif ".ffn.experts." in name:
            q, s = quantize_fp4_packed(official[name], scale_dtype=torch.float8_e8m0fnu)
            tensors[name], tensors[name.removesuffix("weight") + "scale"] = q, s
            want[name] = ref_fp4(q, s)
    save_file(tensors, tmp_path / "model.safetensors")
    got = load_checkpoint(tmp_path, spec, progress=False)
    assert_same(got, want, spec)
    assert not torch.equal(got["layers.1.ffn.experts.0.w1.weight"], official["layers.1.ffn.experts.0.w1.weight"])
    assert torch.allclose(got["layers.1.ffn.experts.0.w1.weight"], official["layers.1.ffn.experts.0.w1.weight"],
                          atol=1.0)  # fmt: skip


def test_merged_quantized_experts_are_split_per_expert(
    tmp_path: Path, folders: dict[str, Path], official: dict[str, torch.Tensor], spec: Spec
) -> None:
    from safetensors.torch import load_file

    tensors = load_file(folders["memory"] / "model.safetensors")
    gate_up = tensors.pop("model.layers.1.mlp.experts.gate_up_proj")  # [E, 2I, D] -> FP4
    q4, s4 = quantize_fp4_packed(gate_up, scale_dtype=torch.float32)
    down = tensors.pop("model.layers.2.mlp.experts.down_proj")  # [E, D, I] -> FP8
    q8, s8 = quantize_fp8_block(down, scale_dtype=torch.float8_e8m0fnu)
    # float4_e2m1fn_x2 storage: the header holds the logical shape and safetensors cannot slice it.
    q4x2, s4x2 = quantize_fp4_packed(tensors.pop("model.layers.3.mlp.experts.gate_up_proj"))
    tensors |= {"model.layers.1.mlp.experts.gate_up_proj": q4, "model.layers.1.mlp.experts.gate_up_proj_scale_inv": s4,
                "model.layers.2.mlp.experts.down_proj": q8, "model.layers.2.mlp.experts.down_proj_scale_inv": s8,
                "model.layers.3.mlp.experts.gate_up_proj": q4x2.view(torch.float4_e2m1fn_x2),
                "model.layers.3.mlp.experts.gate_up_proj_scale_inv": s4x2}  # fmt: skip
    save_file(tensors, tmp_path / "model.safetensors")
    got = load_checkpoint(tmp_path, spec, progress=False)
    inter = TINY["moe_intermediate_size"]
    want = dict(official)
    for x in range(TINY["n_routed_experts"]):
        full = ref_fp4(q4[x], s4[x])
        want[f"layers.1.ffn.experts.{x}.w1.weight"] = full[:inter]
        want[f"layers.1.ffn.experts.{x}.w3.weight"] = full[inter:]
        want[f"layers.2.ffn.experts.{x}.w2.weight"] = ref_fp8(q8[x], s8[x])
        full = ref_fp4(q4x2[x], s4x2[x])
        want[f"layers.3.ffn.experts.{x}.w1.weight"] = full[:inter]
        want[f"layers.3.ffn.experts.{x}.w3.weight"] = full[inter:]
    assert_same(got, want, spec)


# --- progress and MTP ----------------------------------------------------------------------------


def test_progress_lines_per_shard_and_mtp_note(
    folders: dict[str, Path], spec: Spec, caplog: pytest.LogCaptureFixture
) -> None:
    n_shards = len(list(folders["sharded"].glob("*.safetensors")))
    with caplog.at_level(logging.INFO, logger="v4serve.engine.model.weights.loader"):
        load_checkpoint(folders["sharded"], spec)
        load_checkpoint(folders["official"], spec)
    lines = [r.getMessage() for r in caplog.records]
    shard_lines = [m for m in lines if m.startswith("loaded shard")]
    assert len(shard_lines) == n_shards + 1
    assert shard_lines[0].startswith(f"loaded shard 1/{n_shards} model-00001-of-")
    assert "(100%)" in shard_lines[n_shards - 1] and "tensors" in shard_lines[0]
    mtp = [m for m in lines if "mtp" in m]
    assert len(mtp) == 1 and "skipping 2 multi-token-prediction" in mtp[0]


def test_heartbeat_inside_a_long_shard(
    folders: dict[str, Path], spec: Spec, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(loader, "_HEARTBEAT_S", 0.0)
    with caplog.at_level(logging.INFO, logger="v4serve.engine.model.weights.loader"):
        load_checkpoint(folders["saved"], spec)
    beats = [r.getMessage() for r in caplog.records if r.getMessage().startswith("loading shard 1/1")]
    assert len(beats) > 10 and "tensors;" in beats[0] and "MB" in beats[0]


def test_progress_goes_to_stderr_without_logging(
    folders: dict[str, Path], spec: Spec, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture
) -> None:
    bare = logging.Logger("bare")  # no handlers anywhere up its (empty) hierarchy
    monkeypatch.setattr(loader, "log", bare)
    load_checkpoint(folders["saved"], spec)
    assert "loaded shard 1/1 model.safetensors" in capsys.readouterr().err
    load_checkpoint(folders["saved"], spec, progress=False)
    assert capsys.readouterr().err == ""


# --- errors --------------------------------------------------------------------------------------


def write(folder: Path, tensors: dict[str, torch.Tensor], name: str = "model.safetensors") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, folder / name)
    return folder


def test_missing_tensors_listed_with_count(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    kept = {k: v for k, v in official.items() if ".ffn.experts." not in k}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(write(tmp_path, kept), spec, progress=False)
    msg = str(err.value)
    n_missing = 4 * TINY["n_routed_experts"] * 3
    assert f"missing {n_missing} tensor(s): layers.0.ffn.experts.0.w1.weight, " in msg
    assert f"... ({n_missing - 10} more)" in msg and str(tmp_path) in msg
    assert "unexpected" not in msg


def test_unexpected_tensor_named_with_its_file(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    extra = {**official, "layers.0.attn.bogus.weight": torch.ones(2)}
    with pytest.raises(
        CheckpointError,
        match=r"unexpected 1 tensor\(s\): layers\.0\.attn\.bogus\.weight "
        r"\('layers\.0\.attn\.bogus\.weight' in model\.safetensors\)",
    ):
        load_checkpoint(write(tmp_path, extra), spec, progress=False)


def test_shape_mismatch_names_tensor_shapes_and_file(
    tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec
) -> None:
    bad = {**official, "layers.2.attn.wq_a.weight": torch.zeros(32, 63)}
    write(tmp_path, bad, "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path, spec, progress=False)
    assert ("layers.2.attn.wq_a.weight: expected [32, 64], found [32, 63] "
            "('layers.2.attn.wq_a.weight' in model-00002-of-00002.safetensors)") in str(err.value)  # fmt: skip
    assert "1 shape mismatch" in str(err.value)


def test_merged_expert_shape_mismatch(tmp_path: Path, folders: dict[str, Path], spec: Spec) -> None:
    from safetensors.torch import load_file

    tensors = load_file(folders["memory"] / "model.safetensors")
    tensors["model.layers.3.mlp.experts.gate_up_proj"] = torch.zeros(4, 62, 64)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(write(tmp_path, tensors), spec, progress=False)
    assert ("layers.3.ffn.experts.0.w1.weight: expected [32, 64], found [31, 64] "
            "('model.layers.3.mlp.experts.gate_up_proj' in model.safetensors)") in str(err.value)  # fmt: skip


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=f"no config.json found at folder {tmp_path}"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="cannot read .*config.json"):
        read_config_json(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    assert read_config_json(tmp_path) == {"hidden_size": 64}
    assert read_config_json(tmp_path / "config.json") == {"hidden_size": 64}


def test_no_safetensors_files_and_no_folder(tmp_path: Path, spec: Spec) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=f"no safetensors files in {tmp_path}"):
        load_checkpoint(tmp_path, spec, progress=False)
    with pytest.raises(CheckpointError, match="does not exist"):
        load_checkpoint(tmp_path / "nope", spec, progress=False)


def test_index_pointing_at_missing_shard(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    write(tmp_path, official, "model-00001-of-00002.safetensors")
    weight_map = {k: "model-00001-of-00002.safetensors" for k in official}
    weight_map["head.weight"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(
        CheckpointError,
        match=r"points at 1 missing shard file\(s\): model-00002-of-00002\.safetensors "
        r"\(e\.g\. model-00002-of-00002\.safetensors should hold head\.weight\)",
    ):
        load_checkpoint(tmp_path, spec, progress=False)


def test_index_listing_tensor_absent_from_shard(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    write(tmp_path, official, "model-00001-of-00001.safetensors")
    weight_map = {k: "model-00001-of-00001.safetensors" for k in [*official, "layers.9.attn.wq_a.weight"]}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"lists 1 tensor\(s\) its shards do not hold: layers\.9\.attn\.wq_a"):
        load_checkpoint(tmp_path, spec, progress=False)


def test_fp8_without_scale_and_bad_scale_shape(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    q, s = quantize_fp8_block(official["layers.0.attn.wq_a.weight"])
    with pytest.raises(
        CheckpointError,
        match=r"FP8 tensor 'layers\.0\.attn\.wq_a\.weight' in model\.safetensors "
        r"has no scale \(looked for layers\.0\.attn\.wq_a\.scale, ",
    ):
        load_checkpoint(write(tmp_path / "a", {**official, "layers.0.attn.wq_a.weight": q}), spec, progress=False)
    bad = {**official, "layers.0.attn.wq_a.weight": q, "layers.0.attn.wq_a.scale": torch.ones(2, 1)}
    with pytest.raises(
        CheckpointError,
        match=r"scale 'layers\.0\.attn\.wq_a\.scale' in model\.safetensors has shape "
        r"\[2, 1\], but 'layers\.0\.attn\.wq_a\.weight' .* needs \[1, 1\]",
    ):
        load_checkpoint(write(tmp_path / "b", bad), spec, progress=False)


def test_wrong_dtypes_and_duplicates(tmp_path: Path, official: dict[str, torch.Tensor], spec: Spec) -> None:
    bad = {**official, "layers.0.ffn.gate.tid2eid": torch.zeros(96, 2), "layers.1.ffn.gate.bias": torch.zeros(4).int()}
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(write(tmp_path / "a", bad), spec, progress=False)
    assert "layers.0.ffn.gate.tid2eid must be an integer tensor, found F32" in str(err.value)
    assert "layers.1.ffn.gate.bias must be a floating tensor, found I32 without a scale" in str(err.value)
    dup = {**official, "model.embed_tokens.weight": official["embed.weight"].clone()}
    with pytest.raises(
        CheckpointError,
        match=r"embed\.weight is given twice: by 'embed\.weight' in model\.safetensors "
        r"and by 'model\.embed_tokens\.weight' in model\.safetensors",
    ):
        load_checkpoint(write(tmp_path / "b", dup), spec, progress=False)


def test_checkpoint_error_is_value_error() -> None:
    assert issubclass(CheckpointError, ValueError)


LOAD_AND_STEP = """
import sys
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.engine.model.v4.tiny import build_tiny
from v4serve.engine.request import Request, SamplingParams
from v4serve.server.config import ServeConfig
from v4serve.server.model_loading import build_engine

folder = write_checkpoint(build_tiny(seed=1), sys.argv[1], quantize="mixed")
for weights in ("checkpoint", "auto"):
    engine, _ = build_engine(ServeConfig(model=str(folder), no_kv_store=True, weight_dtype=weights), None, 0)
    engine.generate([Request("r", list(range(1, 40)), SamplingParams(max_tokens=3))])
print(sorted(m for m in ("torch._dynamo", "sympy") if m in sys.modules))
"""


def test_loading_and_serving_never_import_torchs_compiler(tmp_path: Path) -> None:
    """Building the model on the meta device and materializing it must not pull in torch._dynamo or
    sympy (torch's Python references do, for `normal_` and `empty_like` of meta tensors): 3.5 s of CPU
    at every engine and rank start, before any work."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", LOAD_AND_STEP, str(tmp_path)], capture_output=True, text=True,
                         timeout=300, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"
