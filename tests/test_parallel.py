"""Tensor and expert parallelism of the model (engine/model/parallel/sharding.py) on CPU ranks over gloo: each
rank loads only its shard of a checkpoint, and two ranks give the single process's logits and
greedy tokens, hold the plan's bytes, and refuse sizes that would split a head, an expert or a
scale block. Every two-rank case runs in one spawn (starting ranks costs seconds)."""

from __future__ import annotations

import functools
import json
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from v4serve.engine.model.parallel import ranks
from v4serve.engine.model.parallel.ranks import SequenceCase, SequenceResult, run_on_ranks, run_sequence
from v4serve.engine.model.parallel.sharding import ParallelConfig
from v4serve.engine.model.plan import GIB, PlanError, PlanSettings, plan_checkpoint
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights import files as checkpoint_files
from v4serve.engine.model.weights.checkpoint import load_model, quantize_checkpoint_state, write_checkpoint
from v4serve.engine.model.weights.files import CheckpointError
from v4serve.engine.model.weights.packed import packed_count

RANKS = 2
# Crosses the window (128), every CSA entry edge (4), the HCA entry and block edge (128); the chunks
# of 48 straddle them; then greedy decodes.
PROMPT = tuple((7 * i + 3) % 300 + 10 for i in range(200))
CHUNK, DECODES = 48, 6
RTOL = 1e-4

CONFIGS = {
    "tiny": tiny_config(),
    # More heads, groups and experts than ranks several times over; an odd vocabulary (rank 0 holds
    # one row more: the logits' all-gather pads rank 1's).
    "wide": tiny_config(num_heads=8, head_dim=32, o_groups=4, o_lora_rank=32, n_routed_experts=16,
                        index_n_heads=8, moe_intermediate_size=32, vocab_size=321),
    # Quantized shards that fall on whole scale blocks at TP 2: 128 rows of wq_b, wo_a and the FP8
    # shared expert per rank, 128 columns of wo_b and of the shared w2, 32-value groups of the FP4 w2.
    "packed": tiny_config(o_lora_rank=128, moe_intermediate_size=256),
}
CASES = [("tiny", False, False), ("tiny", True, False), ("wide", False, False), ("wide", True, False),
         ("packed", False, True), ("packed", True, True)]  # (config, expert parallel, packed)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    out = {}
    for name, cfg in CONFIGS.items():
        out[name] = write_checkpoint(build_tiny(cfg, seed=5), tmp_path_factory.mktemp(name),
                                     quantize="mixed" if name == "packed" else None)
    return out


def case_of(folders: dict[str, Path], name: str, ep: bool, packed: bool) -> SequenceCase:
    return SequenceCase(str(folders[name]), ep, packed, PROMPT, CHUNK, DECODES)


@contextmanager
def squatted_port() -> Iterator[int]:
    """A loopback port another process already listens on (and answers garbage on): what a port
    chosen for a rendezvous and bound only later becomes when something else takes it in between."""
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", 0))
        squatter.listen(8)

        def answer() -> None:
            while True:
                try:
                    conn, _ = squatter.accept()
                except OSError:
                    return
                with conn:
                    conn.sendall(b"HTTP/1.1 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        yield squatter.getsockname()[1]


@pytest.fixture(scope="module")
def two_ranks(folders: dict[str, Path]) -> dict[tuple[str, bool, bool], SequenceResult]:
    """Every case on two ranks, in one spawn. The launcher once picked a free port, released it and
    had rank 0 bind it; on a busy machine another process took it first and the ranks aborted
    (SIGABRT in the rendezvous). Handing that launcher a taken port reproduces it; the ranks now meet
    through a store bound to a port the OS assigns while binding, so nothing can take it."""
    with squatted_port() as taken, pytest.MonkeyPatch.context() as patch:
        patch.setattr(ranks, "free_port", lambda: taken, raising=False)
        results = run_on_ranks([case_of(folders, *case) for case in CASES], RANKS)
    return dict(zip(CASES, results, strict=True))


@functools.cache
def single(folder: str, packed: bool) -> SequenceResult:
    return run_sequence(load_model(folder, packed=packed, progress=False),
                        SequenceCase(folder, False, packed, PROMPT, CHUNK, DECODES))


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'ep' if c[1] else 'tp'}")
def test_two_ranks_give_the_single_process_logits_and_tokens(folders, two_ranks, case) -> None:
    name, _, packed = case
    want = single(str(folders[name]), packed)
    got = two_ranks[case]
    assert got.logits.shape == want.logits.shape == (len(PROMPT) + DECODES, CONFIGS[name].vocab_size)
    assert rel_err(got.logits, want.logits) <= RTOL
    assert got.tokens == want.tokens
    # One latent KV head: every rank holds the whole KV cache, and the same bytes in it.
    assert len(got.kv_digests) == RANKS and len(set(got.kv_digests)) == 1


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{'ep' if c[1] else 'tp'}")
def test_each_rank_holds_the_plans_bytes(folders, two_ranks, case) -> None:
    name, ep, packed = case
    settings = PlanSettings(memory_bytes=GIB, tensor_parallel_size=RANKS, expert_parallel=ep, device="cpu",
                            weight_dtype="checkpoint" if packed else "fp32")
    planned = plan_checkpoint(folders[name], settings).weights_per_rank.total
    held = two_ranks[case].resident_bytes
    assert len(held) == RANKS and max(held) == held[0]  # the plan counts the largest rank: rank 0
    assert abs(held[0] - planned) <= 0.01 * planned
    whole = plan_checkpoint(folders[name], PlanSettings(memory_bytes=GIB, device="cpu",
                                                        weight_dtype=settings.weight_dtype)).weights_per_rank.total
    assert held[0] < 0.75 * whole


def test_collectives_per_decode_step(folders, two_ranks) -> None:
    """One all-reduce per attention and per MoE, one per CSA layer's index scores, one for the
    embedding, and the logits' all-gather."""
    cfg = CONFIGS["tiny"]
    traffic = two_ranks[("tiny", False, False)].decode_traffic
    csa = sum(cfg.layer_kind(i) == "csa" for i in range(cfg.num_layers))
    assert traffic["calls"] == 1 + 2 * cfg.num_layers + csa + 1
    assert traffic["all_gather"] == cfg.vocab_size * 4  # fp32 logits of one row, both halves


@pytest.mark.parametrize(("name", "ep", "packed"), [("tiny", False, False), ("wide", True, False),
                                                    ("packed", False, True), ("packed", True, True)])
def test_shards_put_together_are_the_whole_checkpoint(folders, name, ep, packed) -> None:
    """Loaded in one process rank by rank (no process group is needed to load): every tensor is
    whole on each rank, or the ranks' parts concatenate to it (codes and scales alike), or under
    expert parallelism exactly one rank holds it."""
    check_shards(folders[name], ep, packed)


def check_shards(folder: Path, ep: bool, packed: bool) -> None:
    whole = load_model(folder, packed=packed, progress=False).state_dict()
    models = [load_model(folder, packed=packed, progress=False, parallel=ParallelConfig(RANKS, ep, rank))
              for rank in range(RANKS)]
    assert all((packed_count(model) > 0) == packed for model in models)
    shards = [model.state_dict() for model in models]
    for key, tensor in whole.items():
        parts = [shard[key] for shard in shards if key in shard]
        if len(parts) == 1:
            assert ep and ".ffn.experts." in key and torch.equal(parts[0], tensor), key
        elif parts[0].shape == tensor.shape:
            assert all(torch.equal(part, tensor) for part in parts), key
        else:
            axis = next(i for i, (a, b) in enumerate(zip(parts[0].shape, tensor.shape, strict=True)) if a != b)
            assert torch.equal(torch.cat(parts, dim=axis), tensor), key
    assert set().union(*shards) == set(whole)


@pytest.mark.parametrize("ep", [False, True])
def test_merged_expert_tensors_and_fp32_scales_shard_alike(tmp_path, ep) -> None:
    """transformers' spelling: experts merged into `gate_up_proj` [E, 2I, D] / `down_proj` (one
    expert's region of them read per rank, the gate and up halves each sliced) with fp32
    `weight_scale_inv` scales."""
    model = build_tiny(CONFIGS["packed"])
    state = quantize_checkpoint_state({k: v.contiguous() for k, v in model.state_dict().items()}, "fp8")
    renamed: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith(".scale"):
            renamed["model." + name.removesuffix(".scale") + ".weight_scale_inv"] = tensor.float()
        else:
            renamed["model." + name] = tensor
    for layer in range(model.cfg.num_layers):
        p = f"model.layers.{layer}"
        for suffix, tail in ((".weight", ""), (".weight_scale_inv", "_scale_inv")):
            def expert(e: int, w: str, suffix: str = suffix, p: str = p) -> torch.Tensor:
                return renamed.pop(f"{p}.ffn.experts.{e}.{w}{suffix}")

            experts = range(model.cfg.n_routed_experts)
            renamed[f"{p}.mlp.experts.gate_up_proj{tail}"] = torch.stack(
                [torch.cat([expert(e, "w1"), expert(e, "w3")]) for e in experts])
            renamed[f"{p}.mlp.experts.down_proj{tail}"] = torch.stack([expert(e, "w2") for e in experts])
    save_file(renamed, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps(model.cfg.to_official_dict()))
    for packed in (True, False):
        check_shards(tmp_path, ep, packed)


def test_expert_parallel_ranks_keep_the_checkpoint_names_of_their_experts(folders) -> None:
    cfg = CONFIGS["wide"]
    state = load_model(folders["wide"], progress=False, parallel=ParallelConfig(RANKS, True, 1)).state_dict()
    held = {int(k.split(".")[4]) for k in state if k.startswith("layers.1.ffn.experts.")}
    assert held == set(range(cfg.n_routed_experts // 2, cfg.n_routed_experts))
    inter, dim = cfg.moe_intermediate_size, cfg.hidden_size
    assert state["layers.1.ffn.experts.8.w1.weight"].shape == (inter, dim)  # whole experts
    assert state["layers.1.ffn.shared_experts.w1.weight"].shape == (inter // 2, dim)  # the shared one split


def test_a_rank_reads_only_its_slices(folders, monkeypatch) -> None:
    """Split tensors are read through `get_slice`, never whole; a rank reads about its own bytes."""
    whole_reads: list[str] = []
    sliced_bytes = [0]
    read, read_region = checkpoint_files.Handles.read, checkpoint_files.Handles.read_region

    def spy_read(self, entry, expert=None):
        whole_reads.append(entry.key)
        return read(self, entry, expert)

    def spy_region(self, entry, expert, region):
        tensor = read_region(self, entry, expert, region)
        sliced_bytes[0] += tensor.numel() * tensor.element_size()
        return tensor

    monkeypatch.setattr(checkpoint_files.Handles, "read", spy_read)
    monkeypatch.setattr(checkpoint_files.Handles, "read_region", spy_region)
    model = load_model(folders["tiny"], progress=False, parallel=ParallelConfig(RANKS, False, 1))
    split = re.compile(r"\.(?:wq_b|wo_a|wo_b|weights_proj|w[123])\.weight$|attn_sink$|^(?:embed|head)\.weight$")
    assert whole_reads and not [k for k in whole_reads if split.search(k)]
    full = sum(t.numel() * t.element_size() for t in load_model(folders["tiny"], progress=False).state_dict().values())
    held = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    assert sliced_bytes[0] < held < 0.6 * full


def test_size_one_is_the_single_process_model(folders) -> None:
    alone = load_model(folders["tiny"], progress=False)
    one = load_model(folders["tiny"], progress=False, parallel=ParallelConfig(1))
    assert one.parallel is None and list(one.state_dict()) == list(alone.state_dict())
    case = SequenceCase(str(folders["tiny"]), prompt=PROMPT[:40], chunk=16, decode_steps=2)
    assert torch.equal(run_sequence(one, case).logits, run_sequence(alone, case).logits)


def test_sizes_that_do_not_divide_are_refused(folders) -> None:
    with pytest.raises(PlanError, match=r"--tensor-parallel-size 3 does not divide the attention heads \(4\)"):
        load_model(folders["tiny"], progress=False, parallel=ParallelConfig(3))
    with pytest.raises(PlanError, match=r"routed experts \(8\)"):
        with torch.device("meta"):
            DeepseekV4(tiny_config(n_routed_experts=8, num_heads=16, o_groups=16, index_n_heads=16,
                                   moe_intermediate_size=48), ParallelConfig(16, True))
    with pytest.raises(ValueError, match="rank 2 is not one of the 2 ranks"):
        ParallelConfig(2, rank=2)


def test_an_fp8_shard_that_would_split_a_scale_block_is_refused_before_reading(tmp_path, monkeypatch) -> None:
    """The tiny model's wo_a has 2 groups of 64 rows: at TP 2 a rank's 64 rows are half a 128-row block."""
    folder = write_checkpoint(build_tiny(), tmp_path, quantize="fp8")
    reads: list[str] = []
    monkeypatch.setattr(checkpoint_files.Handles, "read", lambda self, entry, expert=None: reads.append(entry.key))
    monkeypatch.setattr(checkpoint_files.Handles, "read_region", lambda self, entry, *a: reads.append(entry.key))
    for packed in (True, False):
        with pytest.raises(CheckpointError, match=r"attn\.wo_a\.weight: this rank's rows \[64, 128\) .* would "
                                                  r"split an FP8 128x128 scale block"):
            load_model(folder, packed=packed, progress=False, parallel=ParallelConfig(RANKS, False, 1))
    assert reads == []
