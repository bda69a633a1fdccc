"""Speculative decoding with DeepSeek-V4's multi-token-prediction layer (`--speculative-config
'{"method": "mtp", ...}'`): loaded from checkpoints, exact, and its own cache state right.

The layer's random weights guess badly (the embedded model is random), so what is tested is what does
not depend on its guesses: greedy output and logits bitwise those of the run without speculation, and
every set of drafts the engine made equal to the drafts of one uncached pass (the main model over the
whole context, the layer over every position, then on its own guesses) — after cold prefills, prefill
chunks, accepted and rejected passes (the scheduler given right or wrong drafts while the layer keeps
drafting beside), prefix hits from memory and from the SSD store, in every SWA mode."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.daemon import PATIENCE, daemon
from tests.helpers import SMALL, engine_for, tokens
from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout
from v4serve.engine.engine import LLMEngine
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint
from v4serve.engine.model.weights.layout import packed_formats
from v4serve.engine.request import Request, SamplingParams
from v4serve.engine.speculative import SpeculativeConfig
from v4serve.kernels.registry import load_kernels

MODES = ["full", "periodic", "zero"]
BASE = tokens(37, 5)
PROMPTS = {"a": BASE * 2 + BASE[:9], "b": tokens(21, 6)}  # 83 tokens: the first output crosses block 5's edge
OUTPUT = 20


@functools.cache
def mtp_model() -> DeepseekV4:
    model = build_tiny(tiny_config(**SMALL, num_nextn_predict_layers=1), seed=11)
    model.use_kernels(load_kernels("torch", "cpu", batch_invariant=True))
    return model


def reference_drafts(model: DeepseekV4, context: list[int], k: int) -> list[int]:
    """The layer's k guesses after `context` (all but its last token computed) from one uncached pass."""
    n = len(context) - 1
    block = model.cfg.block_size
    kv = DeviceKV(KVLayout.from_config(model.cfg, None, mtp_layers=1), num_slots=1,
                  num_blocks=-(-(n + k) // block) + 1)
    table = list(range(kv.num_blocks))
    _, states = model.forward_states(torch.tensor(context[:-1]), AttentionMetadata.build(
        [SeqChunk(0, table, 0, n)], [range(0)]), kv)
    logits, out = model.forward_mtp(states, torch.tensor(context[1:]),
                                    AttentionMetadata.build([SeqChunk(0, table, 0, n)]), kv)
    guesses = [int(logits.argmax(-1))]
    h = out[-1:]
    for j in range(1, k):
        logits, h = model.forward_mtp(h, torch.tensor(guesses[-1:]),
                                      AttentionMetadata.build([SeqChunk(0, table, n - 1 + j, 1)]), kv)
        guesses.append(int(logits.argmax(-1)))
    return guesses


def request(rid: str, prompt: list[int], n: int = OUTPUT) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True))


def recording(engine: LLMEngine) -> list[tuple[list[int], list[int]]]:
    """Every (context, drafts) the engine's MTP layer makes from now on."""
    made: list[tuple[list[int], list[int]]] = []
    assert engine.mtp is not None
    propose = engine.propose_drafts

    def record(requests: list[Request]) -> None:
        propose(requests)
        made.extend((r.all_token_ids, list(r.mtp_drafts)) for r in requests)

    engine.propose_drafts = record  # type: ignore[method-assign]
    return made


def run(requests: list[Request], engine: LLMEngine) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    for r in requests:
        engine.add_request(r)
    engine.run_checked()  # the cache's integrity after every step
    return ({r.request_id: list(r.output_token_ids) for r in requests},
            {r.request_id: torch.stack(engine.logits.pop(r.request_id)) for r in requests})


def mtp_engine(k: int, **config: object) -> LLMEngine:
    return engine_for(mtp_model(), speculative=SpeculativeConfig("mtp", k), **config)


@functools.cache
def cold(mode: str) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    return run([request(rid, p) for rid, p in PROMPTS.items()], engine_for(mtp_model(), swa_cache_mode=mode))


def truth_drafts(truth: dict[str, list[int]], wrong_at: int | None) -> Callable[[Request, int], list[int]]:
    """The scheduler's drafts: the cold run's next tokens (kept), or wrong at draft `wrong_at` (rejected
    there); the MTP layer still drafts beside them."""

    def draft(req: Request, most: int) -> list[int]:
        made = len(req.output_token_ids)
        drafts = list(truth.get(req.request_id, [])[made:made + 3])[:most]
        if wrong_at is not None and wrong_at < len(drafts):
            drafts[wrong_at] = drafts[wrong_at] % 300 + 1
        return drafts

    return draft


def assert_drafts_match_the_reference(made: list[tuple[list[int], list[int]]], k: int) -> None:
    assert made
    for context, drafts in made:
        assert drafts == reference_drafts(mtp_model(), context, k), f"after {len(context)} tokens"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize(("k", "scheduled"), [(1, "mtp"), (3, "mtp"), (3, "kept"), (2, "rejected at the second")])
def test_drafts_are_the_uncached_layers_and_tokens_the_run_without_speculation(mode: str, k: int,
                                                                                 scheduled: str) -> None:
    truth, want = cold(mode)
    engine = mtp_engine(k, swa_cache_mode=mode, max_prefill_chunk=32)  # the 83-token prompt in 3 chunks
    if scheduled != "mtp":
        engine.scheduler.drafter = truth_drafts(truth, None if scheduled == "kept" else 1)
    made = recording(engine)
    outputs, logits = run([request(rid, p) for rid, p in PROMPTS.items()], engine)
    assert outputs == truth
    for rid in PROMPTS:
        assert torch.equal(logits[rid], want[rid]), rid
    assert engine.spec.drafts > 0
    if scheduled == "kept":
        assert engine.spec.accepted_tokens == engine.spec.draft_tokens
    if scheduled.startswith("rejected"):
        assert 0 < engine.spec.accepted_tokens < engine.spec.draft_tokens
    assert_drafts_match_the_reference(made, k)


@pytest.mark.parametrize("mode", MODES)
def test_after_a_prefix_hit_the_layer_drafts_as_from_a_cold_context(mode: str) -> None:
    """The layer's window rows and pending state come back with the slot's snapshot (or are computed
    again with the window in zero mode): its drafts after a hit are those of an uncached pass."""
    truth, _ = cold(mode)
    engine = mtp_engine(2, swa_cache_mode=mode)
    run([request("a", PROMPTS["a"])], engine)
    made = recording(engine)
    for n in (47, 48, 49, 64, 83):  # around block (16) and window (8) edges, and the whole prompt
        follow = PROMPTS["a"][:n] + tokens(5, 60 + n) if n < 83 else PROMPTS["a"] + truth["a"][:10]
        plain = run([request("cold", follow, 8)], engine_for(mtp_model(), swa_cache_mode=mode))[0]["cold"]
        hits = engine.scheduler.stats.prefix_hits
        outputs, _ = run([request(f"hit{n}", follow, 8)], engine)
        assert engine.scheduler.stats.prefix_hits > hits
        assert outputs[f"hit{n}"] == plain
    assert_drafts_match_the_reference(made, 2)


def test_a_disk_hit_brings_the_layers_state_back(tmp_path: Path) -> None:
    config = {"swa_cache_mode": "periodic", "kv_store_dir": str(tmp_path)}
    first = mtp_engine(2, **config)
    run([request("a", PROMPTS["a"])], first)
    first.close()  # queued files land
    engine = mtp_engine(2, **config)
    made = recording(engine)
    follow = PROMPTS["a"] + tokens(3, 9)
    hit = request("again", follow, 8)
    outputs, _ = run([hit], engine)
    engine.close()
    assert hit.num_disk_hit_tokens > 0
    assert outputs["again"] == run([request("c", follow, 8)], engine_for(mtp_model()))[0]["c"]
    assert_drafts_match_the_reference(made, 2)


# ---- loading ---------------------------------------------------------------------------------------------------
def test_make_checkpoint_writes_the_layer_and_loading_reads_it_only_when_asked(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    model = build_tiny(tiny_config(**SMALL, num_nextn_predict_layers=1), seed=3)
    folder = write_checkpoint(model, tmp_path / "ckpt")
    assert json.loads((folder / "config.json").read_text())["num_nextn_predict_layers"] == 1
    with caplog.at_level(logging.INFO):
        plain = load_model(folder, progress=True)
    assert len(plain.mtp) == 0 and "skipping" in caplog.text and "multi-token-prediction" in caplog.text
    loaded = load_model(folder, mtp=True)
    want = {k: v for k, v in model.state_dict().items()}
    got = loaded.state_dict()
    mtp_names = [k for k in want if k.startswith("mtp.0.")]
    assert len(mtp_names) > 20 and all(torch.equal(got[k], want[k]) for k in mtp_names)


def test_packed_checkpoint_keeps_the_layers_fp8_and_fp4_weights_packed(tmp_path: Path) -> None:
    model = build_tiny(tiny_config(**{**SMALL, "moe_intermediate_size": 128, "o_lora_rank": 128},
                                   num_nextn_predict_layers=1), seed=3)
    folder = write_checkpoint(model, tmp_path / "packed", quantize="mixed")
    formats = packed_formats(folder, mtp=True)
    assert "mtp.0.e_proj.weight" in formats and "mtp.0.attn.wq_a.weight" in formats
    assert any(name.startswith("mtp.0.ffn.experts.") for name in formats)
    assert not any(name.startswith("mtp.") for name in packed_formats(folder))
    packed = load_model(folder, packed=True, mtp=True)
    dense = load_model(folder, mtp=True)
    packed.use_kernels(load_kernels("torch", "cpu"))
    dense.use_kernels(load_kernels("torch", "cpu"))
    context = tokens(30, 2)
    assert reference_drafts(packed, context, 2) == reference_drafts(dense, context, 2)


def test_a_checkpoint_without_the_layer_is_refused_clearly(tmp_path: Path) -> None:
    folder = write_checkpoint(build_tiny(tiny_config(**SMALL), seed=3), tmp_path / "none")
    with pytest.raises(ValueError, match="no multi-token-prediction layer"):
        load_model(folder, mtp=True)
    # A config that names the layer, files that lack it (as transformers saves a model).
    dropped = write_checkpoint(build_tiny(tiny_config(**SMALL, num_nextn_predict_layers=1), seed=3),
                               tmp_path / "dropped")
    (file,) = dropped.glob("*.safetensors")
    save_file({k: v for k, v in load_file(file).items() if not k.startswith("mtp.")}, file)
    assert len(load_model(dropped).mtp) == 0  # served without drafts, it loads
    with pytest.raises(ValueError, match="holds no multi-token-prediction tensors"):
        load_model(dropped, mtp=True)


# ---- settings and the daemon -------------------------------------------------------------------------------------
def test_mtp_settings_parse_and_bad_ones_are_refused() -> None:
    spec = SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2}')
    assert (spec.method, spec.num_speculative_tokens) == ("mtp", 2) and "multi-token-prediction" in spec.describe()
    with pytest.raises(ValueError, match="apply to method 'ngram' only"):
        SpeculativeConfig.parse('{"method": "mtp", "num_speculative_tokens": 2, "prompt_lookup_max": 3}')


def test_the_daemon_serves_with_mtp_drafts_the_same_greedy_text_and_counts_them(tmp_path: Path) -> None:
    """From a folder `make-checkpoint --set num_nextn_predict_layers=1` wrote (and the plan of it): the
    same greedy completions with MTP drafts as without, the drafts counted and the setting shown."""
    folder = tmp_path / "ckpt"
    cli = [sys.executable, "-m", "v4serve.server.cli"]
    subprocess.run([*cli, "make-checkpoint", str(folder), "--set", "num_nextn_predict_layers=1"], check=True,
                   capture_output=True, timeout=PATIENCE)
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 2})
    plan = subprocess.run([*cli, "plan", "--model", str(folder), "--device", "cpu", "--json",
                           "--speculative-config", spec], capture_output=True, text=True, timeout=PATIENCE)
    assert plan.returncode == 0 and json.loads(plan.stdout)["mtp_layers_loaded"] == 1
    body = {"prompt": "the same words, the same words, the same", "max_tokens": 24, "temperature": 0, "n": 2}
    with daemon("--model", str(folder)) as url:
        plain = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE).json()
    with daemon("--model", str(folder), "--speculative-config", spec) as url:
        drafted = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE).json()
        version = httpx.get(url + "/version", timeout=PATIENCE).json()
        metrics = httpx.get(url + "/metrics", timeout=PATIENCE).text
    assert [c["text"] for c in drafted["choices"]] == [c["text"] for c in plain["choices"]]
    assert version["speculative"].startswith("mtp, 2 draft tokens")
    drafts = [line for line in metrics.splitlines() if line.startswith("v4serve_spec_decode_num_drafts_total")]
    assert drafts and float(drafts[0].split()[-1]) > 0

def test_the_capacity_plan_counts_the_layer_only_when_it_is_loaded(tmp_path: Path) -> None:
    from v4serve.engine.model.plan import GIB, PlanSettings, plan_model

    off = plan_model("deepseek-v4-flash", PlanSettings(memory_bytes=141 * GIB)).to_dict()
    on = plan_model("deepseek-v4-flash", PlanSettings(memory_bytes=141 * GIB, mtp=True)).to_dict()
    assert off["skipped"]["mtp_layers"] == 1 and off["mtp_layers_loaded"] == 0
    assert on["skipped"] == {"mtp_layers": 0, "mtp_tensors": 0, "mtp_bytes": 0} and on["mtp_layers_loaded"] == 1
    assert on["checkpoint_bytes"] - off["checkpoint_bytes"] == off["skipped"]["mtp_bytes"]
    assert on["weight_bytes_per_rank"]["total"] > off["weight_bytes_per_rank"]["total"]
    # Its window (128 rows of 512 bf16 channels) and the 4 x 4096 bf16 state it waits on, per request.
    assert on["state_cache_bytes_per_request"] - off["state_cache_bytes_per_request"] == 128 * 512 * 2 + 4 * 4096 * 2
    folder = write_checkpoint(build_tiny(tiny_config(**SMALL, num_nextn_predict_layers=1), seed=3), tmp_path / "c")
    small_off = plan_model(str(folder), PlanSettings(memory_bytes=GIB, device="cpu")).to_dict()
    small_on = plan_model(str(folder), PlanSettings(memory_bytes=GIB, device="cpu", mtp=True)).to_dict()
    assert small_off["skipped"]["mtp_tensors"] > 20 and small_on["skipped"]["mtp_tensors"] == 0
    assert small_on["checkpoint_bytes"] - small_off["checkpoint_bytes"] == small_off["skipped"]["mtp_bytes"]


def test_a_grammar_request_drafts_only_what_its_grammar_allows_and_keeps_its_tokens() -> None:
    """Structured outputs with MTP drafts: the layer's guesses the grammar forbids are cut before the
    pass; tokens and logits are the run without speculation's, and the layer's drafts stay exact."""
    from v4serve.engine.request import GrammarSpec
    from v4serve.server.text.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    vocab = tokenizer.vocabulary_json()
    grammar = GrammarSpec("lark", 'start: item ("," item)*\nitem: "ab" | "cab" | "bca" | "abc"', "response_format")

    def constrained() -> Request:
        params = SamplingParams(max_tokens=OUTPUT, logit_bias={tokenizer.eos_token_id: -100}, grammar=grammar)
        return Request("g", PROMPTS["a"][:40], params)

    truth, want = run([constrained()], engine_for(mtp_model(), tokenizer_json=vocab))
    engine = mtp_engine(2, tokenizer_json=vocab)
    made = recording(engine)
    outputs, logits = run([constrained()], engine)
    assert outputs == truth and torch.equal(logits["g"], want["g"])
    assert set(tokenizer.decode(truth["g"])) <= set("abc,")
    assert_drafts_match_the_reference(made, 2)


def test_the_layer_loads_from_transformers_style_names_too(tmp_path: Path) -> None:
    """The block's attention, norms, mHC and merged experts under `model.mtp.0.` as transformers spells a
    layer's (its own projections, norms and head under their names): the same tensors as the official."""
    from v4serve.engine.model.weights.layout import _LAYER_ALIASES

    model = build_tiny(tiny_config(**SMALL, num_nextn_predict_layers=1), seed=3)
    official = write_checkpoint(model, tmp_path / "official")
    (file,) = official.glob("*.safetensors")
    tensors = load_file(file)
    renamed: dict[str, torch.Tensor] = {}
    experts = {"w1": {}, "w2": {}, "w3": {}}
    for name, t in tensors.items():
        if not name.startswith("mtp.0."):
            renamed[name] = t
            continue
        rest = name.removeprefix("mtp.0.")
        if rest.startswith("ffn.experts."):
            _, _, e, w, _ = rest.split(".")
            experts[w][int(e)] = t
            continue
        for source, target in _LAYER_ALIASES:
            if rest == target or (target.endswith(".") and rest.startswith(target)):
                rest = source + rest[len(target):]
                break
        renamed[f"model.mtp.0.{rest}"] = t
    n = len(experts["w1"])
    renamed["model.mtp.0.mlp.experts.gate_up_proj"] = torch.stack(
        [torch.cat([experts["w1"][e], experts["w3"][e]]) for e in range(n)])
    renamed["model.mtp.0.mlp.experts.down_proj"] = torch.stack([experts["w2"][e] for e in range(n)])
    assert any(".self_attn." in k for k in renamed) and any(".input_layernorm." in k for k in renamed)
    save_file(renamed, file)
    loaded = load_model(official, mtp=True).state_dict()
    assert all(torch.equal(loaded[k], v) for k, v in model.state_dict().items())
