"""--batch-invariant: a request's logits are bitwise the same alone, inside ragged batches mixing
prefill chunks and decodes, under any prefill chunking, and after a prefix-cache hit as in a cold
run — on the torch backend and on the Triton backend (interpreted on a CPU). The small config
(window 8, blocks of 16, ratios 4/16) makes a 33-token prompt cross window, entry and block edges;
a 16-token budget leaves its last prompt token alone in a chunk, i.e. on the decode path."""

from __future__ import annotations

import httpx
import pytest
import torch
import torch.nn.functional as F

from tests.daemon import daemon
from tests.helpers import SMALL, engine_for, greedy, requires_triton, tokens
from v4serve.engine.model import attention
from v4serve.engine.model.model import DeepseekV4
from v4serve.engine.model.tiny import build_tiny, tiny_config
from v4serve.kernels import invariant
from v4serve.kernels.registry import load_kernels
from v4serve.server.config import ServeConfig
from v4serve.server.model_loading import engine_config, load, version_info

PROMPT = tokens(33, 1)
MATES = {"short": tokens(5, 2), "long": tokens(20, 3)}


def invariant_model(backend: str) -> DeepseekV4:
    model = build_tiny(tiny_config(**SMALL), seed=11)
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


def test_daemon_flag_shows_in_version() -> None:
    with daemon("--attention-backend", "torch", "--batch-invariant") as url:
        info = httpx.get(url + "/version").json()
        assert info["batch_invariant"] is True and info["attention_backend"] == "torch"
        body = {"model": "v4serve-tiny", "prompt": "Hello", "max_tokens": 2, "temperature": 0}
        assert httpx.post(url + "/v1/completions", json=body, timeout=120).json()["usage"]["completion_tokens"] == 2
