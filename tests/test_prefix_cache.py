"""Prefix hits in every SWA caching mode give the cold run's greedy tokens and logits, at block
and window edges and off by one on each side."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import engine_for, greedy, reference, rel_err, small_model, tiny_model, tokens

MODES = ["full", "periodic", "zero"]


def shared_then_different(shared: int, seed: int) -> tuple[list[int], list[int]]:
    """Two prompts that agree on exactly `shared` tokens."""
    base = tokens(shared, seed)
    a, b = tokens(9, seed + 1), tokens(9, seed + 2)
    b[0] = a[0] + 1 if a[0] < 319 else a[0] - 1
    return base + a, base + b


def run_pair(model, mode: str, shared: int, seed: int = 0):
    first, second = shared_then_different(shared, seed)
    engine = engine_for(model, swa_cache_mode=mode)
    engine.generate([greedy("first", first)])
    before = engine.device_kv.layers[1].entries.clone()
    req = greedy("second", second)
    out = engine.generate([req])["second"]
    engine.check()
    return engine, req, out, second, before


def check_hit(model, mode, shared):
    engine, req, out, prompt, before = run_pair(model, mode, shared)
    cold = engine_for(model, enable_prefix_caching=False)
    cold_req = greedy("cold", prompt)
    cold_out = cold.generate([cold_req])["cold"]
    assert out == cold_out, "a cache hit must give the cold run's greedy tokens"
    assert rel_err(torch.stack(engine.logits["second"]), torch.stack(cold.logits["cold"])) <= 1e-4
    ref = reference(model, prompt, out)
    assert rel_err(torch.stack(engine.logits["second"]), ref) <= 1e-4
    b = model.cfg.block_size
    expected_hit = min(shared, len(prompt) - 1) // b * b
    assert req.num_hit_tokens == expected_hit
    assert cold_req.num_hit_tokens == 0
    # Sealed shared blocks are never written again.
    hit_blocks = req.kv.block_table[: expected_hit // b] if req.kv.block_table else None
    if hit_blocks is None:
        hit_blocks = list(range(expected_hit // b))  # the first request's blocks, reused in order
    after = engine.device_kv.layers[1].entries
    assert torch.equal(before[hit_blocks], after[hit_blocks])
    return req


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 48, 49, 64, 80, 81])
def test_hit_equals_cold_small_model(mode, shared):
    """Blocks of 16, window 8, 5 layers: the zero-mode span is 35 tokens, so short hits
    recompute from the start and longer ones from inside the prefix."""
    req = check_hit(small_model(), mode, shared)
    if mode == "full" and req.num_hit_tokens:
        assert req.num_recomputed_tokens == 0  # a snapshot at every sealed boundary
    if mode == "zero" and req.num_hit_tokens:
        assert req.num_recomputed_tokens == min(req.num_hit_tokens, 35)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shared", [127, 128, 129, 255, 256, 257, 640])
def test_hit_equals_cold_tiny_model(mode, shared):
    """The embedded model: blocks of 128 = the window; zero mode recomputes 4·127 tokens."""
    check_hit(tiny_model(), mode, shared)


def test_shared_part_shorter_than_a_block_is_no_hit():
    engine, req, out, prompt, _ = run_pair(small_model(), "full", 10)
    assert req.num_hit_tokens == 0 and req.num_cached_tokens == 0


def test_identical_prompt_keeps_the_last_token_computed():
    model = small_model()
    prompt = tokens(48, 5)  # exactly three blocks
    engine = engine_for(model, swa_cache_mode="full")
    first = engine.generate([greedy("a", prompt)])["a"]
    req = greedy("b", prompt)
    assert engine.generate([req])["b"] == first
    assert req.num_hit_tokens == 32  # capped: the last prompt token is computed


def test_periodic_mode_restores_the_latest_snapshot_then_recomputes():
    model = small_model()
    # Interval 32: snapshots at 32, 64 and at each prompt's last boundaries.
    first = tokens(100, 6)  # snapshots at 32, 64, 96
    engine = engine_for(model, swa_cache_mode="periodic", swa_checkpoint_interval=32)
    engine.generate([greedy("a", first)])
    second = first[:90] + tokens(20, 7)  # hit 80 tokens (5 blocks); latest snapshot ≤ 80 is 64
    req = greedy("b", second)
    out = engine.generate([req])["b"]
    assert (req.num_hit_tokens, req.num_cached_tokens, req.num_recomputed_tokens) == (80, 64, 16)
    assert out == engine_for(model, enable_prefix_caching=False).generate([greedy("c", second)])["c"]


def test_cache_salt_separates_tenants():
    model = small_model()
    prompt = tokens(70, 8)
    engine = engine_for(model)
    engine.generate([greedy("a", prompt, salt="tenant-a")])
    other = greedy("b", prompt, salt="tenant-b")
    same = greedy("c", prompt, salt="tenant-a")
    engine.generate([other])
    engine.generate([same])
    assert other.num_hit_tokens == 0
    assert same.num_hit_tokens == 64


def test_no_prefix_caching_never_hits():
    model = small_model()
    prompt = tokens(70, 9)
    engine = engine_for(model, enable_prefix_caching=False)
    engine.generate([greedy("a", prompt)])
    req = greedy("b", prompt)
    engine.generate([req])
    assert req.num_hit_tokens == 0
