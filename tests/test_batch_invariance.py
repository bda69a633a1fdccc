"""--batch-invariant: a request's logits are bitwise the same alone, inside ragged batches mixing
prefill chunks and decodes, under any prefill chunking, and after a prefix-cache hit as in a cold
run — on the torch backend and on the Triton backend (interpreted on a CPU). The small config
(window 8, blocks of 16, ratios 4/16) makes a 33-token prompt cross window, entry and block edges;
a 16-token budget leaves its last prompt token alone in a chunk, i.e. on the decode path."""

from __future__ import annotations

import uuid

import httpx
import pytest
import torch
import torch.nn.functional as F

from tests.daemon import PATIENCE, daemon
from tests.helpers import SMALL_ONE_OF_EACH, engine_for, greedy, requires_triton, tokens
from tests.test_server import solo_then_together
from v4serve.cache.layout import key_record
from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.model.v4 import attention
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.kernels import invariant
from v4serve.kernels.registry import load_kernels
from v4serve.server.config import ServeConfig
from v4serve.server.model_loading import engine_config, load, version_info

PROMPT = tokens(33, 1)
MATES = {"short": tokens(5, 2), "long": tokens(20, 3)}


def invariant_model(backend: str) -> DeepseekV4:
    model = build_tiny(tiny_config(**SMALL_ONE_OF_EACH), seed=11)
    model.use_kernels(load_kernels(backend, "cpu", batch_invariant=True))
    return model


def run(model: DeepseekV4, prompts: dict[str, list[int]], budget: int, n: int = 3, **engine_args
        ) -> tuple[dict[str, list[int]], dict[str, torch.Tensor]]:
    """Greedy outputs and every sampled row's logits, per request."""
    engine = engine_for(model, max_num_batched_tokens=budget, enable_prefix_caching=False, **engine_args)
    out = engine.generate([greedy(rid, p, n=n) for rid, p in prompts.items()])
    engine.check()
    return out, {rid: torch.stack(rows) for rid, rows in engine.logits.items()}


def assert_same_alone_and_batched(model: DeepseekV4, scenarios: list[tuple[dict[str, list[int]], int]],
                                  **engine_args) -> None:
    want_tokens, want_logits = run(model, {"a": PROMPT}, budget=2048, **engine_args)
    for prompts, budget in scenarios:
        got_tokens, got_logits = run(model, prompts, budget, **engine_args)
        assert got_tokens["a"] == want_tokens["a"], (list(prompts), budget)
        assert torch.equal(got_logits["a"], want_logits["a"]), (list(prompts), budget)


def test_per_row_forms_equal_the_batched_ops() -> None:
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 96, generator=gen), torch.randn(40, 96, generator=gen)
    want = F.linear(x, w)
    assert ((invariant.linear_rows(x, w) - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert ((invariant.linear_rows(x[1:, 3:67], w[:, :64]) - F.linear(x[1:, 3:67], w[:, :64])).abs().max()
            <= 1e-5 * want.abs().max())  # unaligned, strided rows are copied, not misread
    groups, wg = torch.randn(13, 2, 48, generator=gen), torch.randn(2, 24, 48, generator=gen)
    want = invariant.grouped_linear(groups, wg)
    assert ((invariant.grouped_linear_rows(groups, wg) - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert torch.equal(invariant.rowwise_rows(torch.sigmoid, x), torch.cat([torch.sigmoid(r[None]) for r in x]))
    assert invariant.linear_rows(x[:0], w).shape == (0, 40)


@pytest.mark.parametrize("keys", ["auto", "fp8"])
def test_torch_backend_logits_are_bitwise_the_same_alone_batched_and_chunked(keys: str) -> None:
    model = invariant_model("torch")
    assert_same_alone_and_batched(model, [
        ({"a": PROMPT}, 16),  # chunks 16, 16, 1: the last prompt token takes the decode path
        ({"a": PROMPT}, 7),
        ({"short": MATES["short"], "a": PROMPT, "long": MATES["long"]}, 16),  # chunks beside decodes
        ({"long": MATES["long"], "a": PROMPT, "short": MATES["short"]}, 11),
        ({"a": PROMPT, **MATES}, 64),  # every prompt in one step
    ], kv_cache_dtype=keys)


def test_indexer_chunk_rows_in_small_score_tiles_pick_the_same_entries(monkeypatch) -> None:
    """A long chunk's rows are scored in tiles bounded by SCORE_BUDGET (long contexts); tiles of a
    few rows, some before the first entry exists, give bitwise the logits of one tile."""
    model = invariant_model("torch")
    want_tokens, want_logits = run(model, {"a": PROMPT}, budget=2048)
    monkeypatch.setattr(attention, "SCORE_BUDGET", 20)  # the 33-token chunk sees ≤ 8 entries: ≥ 2 rows a tile
    got_tokens, got_logits = run(model, {"a": PROMPT}, budget=2048)
    assert got_tokens == want_tokens and torch.equal(got_logits["a"], want_logits["a"])


@pytest.mark.parametrize("keys", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["full", "periodic", "zero"])
def test_torch_backend_prefix_hits_are_bitwise_cold_runs(mode: str, keys: str) -> None:
    """A hit of 32 tokens (two blocks) restored by each SWA mode, then 4 new tokens and decodes. With
    FP8 keys too: a recomputed key rounds to the same e4m3 code only if it is bitwise the same."""
    model = invariant_model("torch")
    shared = tokens(33, 5)
    second = shared + tokens(6, 7)
    engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=16, max_num_batched_tokens=16,
                        kv_cache_dtype=keys)
    engine.generate([greedy("first", shared + tokens(6, 6), n=3)])
    hit = greedy("second", second, n=4)
    out = engine.generate([hit])["second"]
    engine.check()
    cold_tokens, cold_logits = run(model, {"cold": second}, budget=2048, n=4, kv_cache_dtype=keys)
    assert hit.num_hit_tokens == 32
    assert out == cold_tokens["cold"]
    assert torch.equal(torch.stack(engine.logits["second"]), cold_logits["cold"])


def decoded_and_prefilled(model: DeepseekV4, toks: list[int], split: int, keys: str
                          ) -> tuple[SingleSequence, torch.Tensor, SingleSequence, torch.Tensor]:
    """toks[:split] as one chunk then the rest one decode step each, and toks as one chunk: each
    sequence with every row's logits."""
    record = key_record(model.cfg.head_dim, model.cfg.rope_dim, "float32", keys)
    decoded = SingleSequence(model, len(toks), record)
    rows = [decoded.step(toks[:split], all_logits=True)] + [decoded.step([t], all_logits=True) for t in toks[split:]]
    prefilled = SingleSequence(model, len(toks), record)
    return decoded, torch.cat(rows), prefilled, prefilled.step(toks, all_logits=True)


def kv_differences(a: SingleSequence, b: SingleSequence) -> list[str]:
    """Every cache tensor (window rings, compressor pending rows, entries, indexer keys) of each
    layer that is not bitwise the same in the two sequences."""
    out = []
    for i, (x, y) in enumerate(zip(a.device_kv.layers, b.device_kv.layers, strict=True)):
        for kind, pairs in (("slot", zip(x.slot_tensors(), y.slot_tensors(), strict=True)),
                            ("block", zip(x.block_tensors(), y.block_tensors(), strict=True))):
            out += [f"layer {i} {kind} tensor {j}" for j, (t, u) in enumerate(pairs) if not torch.equal(t, u)]
    return out


@pytest.mark.parametrize("keys", ["auto", "fp8"])
@pytest.mark.parametrize("split", [7, 8, 9, 15, 16, 17, 31, 32, 33])  # window 8, entries of 4 and 16, blocks of 16
def test_torch_backend_kv_written_by_decode_steps_is_the_prefill_kv(split: int, keys: str) -> None:
    """A response's KV is written by decode steps; a later turn computed cold writes the same tokens'
    KV in a prefill chunk. Under --batch-invariant the two are the same bytes (so a follow-up turn
    resumed from a response end is bitwise a cold run), and so are the logits of every position."""
    toks = tokens(41, 13)
    decoded, decoded_logits, prefilled, prefilled_logits = decoded_and_prefilled(invariant_model("torch"), toks,
                                                                                 split, keys)
    assert kv_differences(decoded, prefilled) == []
    assert torch.equal(decoded_logits, prefilled_logits)


@requires_triton
def test_triton_backend_kv_written_by_decode_steps_is_the_prefill_kv() -> None:
    """Decodes at 15, 16 and 17: they complete an entry of 4, an entry of 16 and a block, and wrap the
    window ring (interpreted Triton decode steps cost seconds each)."""
    toks = tokens(18, 13)
    decoded, decoded_logits, prefilled, prefilled_logits = decoded_and_prefilled(invariant_model("triton"), toks,
                                                                                 15, "fp8")
    assert kv_differences(decoded, prefilled) == []
    assert torch.equal(decoded_logits, prefilled_logits)


@requires_triton
def test_triton_backend_logits_are_bitwise_the_same_alone_batched_and_chunked() -> None:
    model = invariant_model("triton")
    assert_same_alone_and_batched(model, [
        ({"a": PROMPT}, 16),
        ({"short": MATES["short"], "a": PROMPT, "long": MATES["long"]}, 11),
    ])


@requires_triton
def test_triton_backend_prefix_hit_is_bitwise_a_cold_run() -> None:
    """Zero mode, the restore that recomputes most: window state rebuilt from an empty state."""
    model = invariant_model("triton")
    shared = tokens(33, 5)
    second = shared + tokens(3, 7)
    engine = engine_for(model, swa_cache_mode="zero", max_num_batched_tokens=64)
    engine.generate([greedy("first", shared + tokens(3, 6), n=1)])
    hit = greedy("second", second, n=2)
    out = engine.generate([hit])["second"]
    cold_tokens, cold_logits = run(model, {"cold": second}, budget=2048, n=2)
    assert hit.num_hit_tokens == 32
    assert out == cold_tokens["cold"]
    assert torch.equal(torch.stack(engine.logits["second"]), cold_logits["cold"])


def test_serve_config_turns_it_on_and_version_reports_it() -> None:
    cfg = ServeConfig(device="cpu", attention_backend="torch", batch_invariant=True, no_kv_store=True)
    model = load(cfg)
    assert model.kernels.batch_invariant and model.layers[0].ffn.gate.kernels is model.kernels
    assert version_info(model, engine_config(cfg, model, None))["batch_invariant"] is True
    plain = load(ServeConfig(device="cpu", attention_backend="torch", no_kv_store=True))
    assert version_info(plain, engine_config(cfg, plain, None))["batch_invariant"] is False


def test_concurrent_streams_are_bitwise_their_solo_runs() -> None:
    """Over HTTP: each prompt alone, then all at once on a cold cache (long ones chunked beside the
    others' decodes), then all at once again as prefix-cache hits: every token and every log-prob
    (top two included) the same, bitwise. Prompts up to 350 characters cross the window and block
    edge (128) and make the indexer choose 16 of up to 90 entries."""
    prompts = [f"{uuid.uuid4().hex[:8]} " + "y" * (6 * i * i) for i in range(8)]
    with daemon("--attention-backend", "torch", "--batch-invariant", "--max-num-batched-tokens", "256") as url:
        solo, cold, warm = solo_then_together(url, prompts, max_tokens=16)
    assert all(f == "length" and len(chosen) == 16 for chosen, _, _, f in solo)
    assert cold == solo
    assert warm == solo


def test_daemon_flag_shows_in_version() -> None:
    with daemon("--attention-backend", "torch", "--batch-invariant") as url:
        info = httpx.get(url + "/version", timeout=PATIENCE).json()
        assert info["batch_invariant"] is True and info["attention_backend"] == "torch"
        body = {"model": "v4serve-tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        reply = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE).json()
        assert reply["usage"]["completion_tokens"] == 2
