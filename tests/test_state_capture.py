"""Snapshots at block boundaries inside a prefill chunk (cache/state_capture.py): the chunk runs
whole and each boundary's slot state is assembled from the rows it wrote. Each such state must be
the one a chunk ending on that boundary leaves (bitwise under batch invariance, both kernel sets,
fp32 and FP8 keys), and a prompt must take one forward pass per chunk, not one per block."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tests.helpers import RecordingEngine, engine_for, greedy, requires_triton, small_model, tokens
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.kernels.registry import load_kernels

BLOCK = 16  # small_model's block; window 8, CSA ratio 4 (overlapping), HCA ratio 16


def model_on(backend: str, batch_invariant: bool) -> DeepseekV4:
    model = small_model()
    model.use_kernels(load_kernels(backend, "cpu", batch_invariant=batch_invariant))
    return model


def splitting(engine: RecordingEngine) -> RecordingEngine:
    """The same engine ending every chunk on each snapshot point (how states were taken before
    capture, and how they still are beside a multi-token-prediction layer)."""
    engine.kv.config = dataclasses.replace(engine.kv.config, snapshots_inside_chunks=False)
    return engine


def snapshots(engine: RecordingEngine, hashes: list[bytes]) -> dict[int, list[torch.Tensor]]:
    """Block count → the host snapshot at that boundary, for every boundary that has one."""
    found = {i + 1: engine.kv.state.snapshots.get(h) for i, h in enumerate(hashes)}
    return {k: v for k, v in found.items() if v is not None}


def run(model: DeepseekV4, prompt: list[int], split: bool, **overrides) -> tuple[RecordingEngine, list[int], int]:
    """(engine, greedy tokens, forward passes the prompt took)."""
    engine = engine_for(model, **overrides)
    if split:
        splitting(engine)
    request = greedy("a", prompt, n=3)
    engine.add_request(request)
    passes = 0
    while request.num_computed_tokens < len(prompt):
        engine.step()
        engine.check()
        passes += 1
    engine.run_checked()
    return engine, request.output_token_ids, passes


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
@pytest.mark.parametrize("mode", ["full", "periodic"])
def test_states_inside_a_chunk_equal_a_chunk_ending_there(mode: str, kv_cache_dtype: str) -> None:
    """A 101-token prompt in one chunk: snapshot points at every block (full) or every 32 tokens and
    the prompt's last boundaries (periodic, interval 32). Every captured state is bitwise the state of
    a run whose chunks end on each point, and the greedy tokens are the same."""
    model = model_on("torch", batch_invariant=True)
    prompt = tokens(101, 3)
    settings = dict(swa_cache_mode=mode, swa_checkpoint_interval=32, kv_cache_dtype=kv_cache_dtype)
    whole, out, passes = run(model, prompt, split=False, **settings)
    split, split_out, split_passes = run(model, prompt, split=True, **settings)
    hashes = whole.kv.hashes(prompt, None)
    got, want = snapshots(whole, hashes), snapshots(split, hashes)
    expected = {k for k in range(1, 7) if mode == "full" or k * BLOCK % 32 == 0 or k == 6}
    assert set(got) == set(want) == expected
    for k in expected:
        assert all(torch.equal(a, b) for a, b in zip(got[k], want[k], strict=True)), f"boundary {k * BLOCK}"
    assert out == split_out
    assert passes == 1 and split_passes == len(expected) + 1


@requires_triton
def test_states_inside_a_chunk_on_the_triton_kernels() -> None:
    """The Triton kernels write the rings themselves: the captured states still equal a split run's
    (bitwise under batch invariance), and a hit on a captured state gives the cold tokens."""
    model = model_on("triton", batch_invariant=True)
    prompt = tokens(52, 4)  # block edges at 16, 32 and 48 (the interpreter is slow: no more than that)
    whole, out, passes = run(model, prompt, split=False, swa_cache_mode="full")
    split, split_out, _ = run(model, prompt, split=True, swa_cache_mode="full")
    hashes = whole.kv.hashes(prompt, None)
    got, want = snapshots(whole, hashes), snapshots(split, hashes)
    assert set(got) == set(want) == {1, 2, 3}
    for k in got:
        assert all(torch.equal(a, b) for a, b in zip(got[k], want[k], strict=True)), f"boundary {k * BLOCK}"
    assert out == split_out and passes == 1
    # A second prompt sharing 3 blocks and one more token restores the state captured at 48.
    second = prompt[:49] + tokens(12, 5)
    request = greedy("b", second, n=3)
    assert whole.generate([request])["b"] == engine_for(model, enable_prefix_caching=False).generate(
        [greedy("c", second, n=3)])["c"]
    assert (request.num_hit_tokens, request.num_cached_tokens, request.num_recomputed_tokens) == (48, 48, 0)


@pytest.mark.parametrize("shared", [47, 48, 49, 63, 64, 65])
def test_a_hit_on_a_captured_state_gives_the_cold_run(shared: int) -> None:
    """Default kernels (no batch invariance): the first prompt runs as one chunk in `full`; a second
    one sharing `shared` tokens resumes from the state captured at its last shared boundary, with
    nothing recomputed, and gives the cold run's tokens and logits within fp32 noise."""
    model = model_on("torch", batch_invariant=False)
    first = tokens(100, 6)
    engine, _, passes = run(model, first, split=False, swa_cache_mode="full")
    assert passes == 1
    second = first[:shared] + tokens(10, 7)
    request = greedy("b", second, n=4)
    out = engine.generate([request])["b"]
    cold = engine_for(model, enable_prefix_caching=False)
    assert out == cold.generate([greedy("c", second, n=4)])["c"]
    want = torch.stack(cold.logits["c"])
    assert (torch.stack(engine.logits["b"]) - want).abs().max() <= 1e-4 * want.abs().max()
    hit = shared // BLOCK * BLOCK
    assert (request.num_hit_tokens, request.num_cached_tokens, request.num_recomputed_tokens) == (hit, hit, 0)


def test_a_rebuilt_window_captures_nothing_before_the_hit_boundary() -> None:
    """After a hit with no snapshot to restore, the window is rebuilt from 35 tokens before the hit
    boundary (64): the states at 32 and 48 inside that span are not a cold run's and are not
    captured; 64 (rebuilt exactly there) and the boundaries after it are, equal to a split run's."""
    model = model_on("torch", batch_invariant=True)
    first, second = tokens(80, 8), None
    got = {}
    for split in (False, True):
        engine = engine_for(model, swa_cache_mode="zero")
        engine.generate([greedy("a", first)])
        assert len(engine.kv.state.snapshots) == 0
        if split:
            splitting(engine)
        second = first[:64] + tokens(40, 9)
        request = greedy("b", second, n=2)
        request.swa_cache_mode = "full"
        engine.generate([request])
        assert (request.num_cached_tokens, request.num_recomputed_tokens) == (64 - 35, 35)
        got[split] = snapshots(engine, engine.kv.hashes(second, None))
    assert set(got[False]) == set(got[True]) == {4, 5, 6}
    for k in got[False]:
        assert all(torch.equal(a, b) for a, b in zip(got[False][k], got[True][k], strict=True))


def test_a_step_captures_at_most_its_allowance_and_ends_the_chunk_past_it() -> None:
    """Captured states wait on the device until the step ends: with room for 2 a step, the 101-token
    prompt's six points in `full` take three passes (2 captured and one chunk end each, then the rest),
    with the same states as a run splitting at every point."""
    model = model_on("torch", batch_invariant=True)
    prompt = tokens(101, 3)
    engine = engine_for(model, swa_cache_mode="full")
    engine.scheduler.config = dataclasses.replace(engine.scheduler.config, max_captured_states=2)
    request = greedy("a", prompt, n=3)
    engine.add_request(request)
    ends = []
    while request.num_computed_tokens < len(prompt):
        engine.step()
        engine.check()
        ends.append(request.num_computed_tokens)
    assert ends == [48, 96, 101]
    engine.run_checked()
    split, _, _ = run(model, prompt, split=True, swa_cache_mode="full")
    hashes = engine.kv.hashes(prompt, None)
    got, want = snapshots(engine, hashes), snapshots(split, hashes)
    assert set(got) == set(want) == {1, 2, 3, 4, 5, 6}
    for k in got:
        assert all(torch.equal(a, b) for a, b in zip(got[k], want[k], strict=True)), f"boundary {k * BLOCK}"


def test_states_already_saved_are_not_captured_again() -> None:
    """A second request over the same prompt computing it again (prompt logprobs: nothing reused)
    captures nothing: every point's state is already saved."""
    model = model_on("torch", batch_invariant=False)
    prompt = tokens(101, 3)
    engine, _, _ = run(model, prompt, split=False, swa_cache_mode="full")
    again = engine.kv.new_request(None, len(prompt), lambda a, b: prompt[a:b])
    assert engine.kv.capture_points(again, 0, len(prompt), len(prompt)) == ()
    fresh = engine.kv.new_request(None, 101, lambda a, b: tokens(101, 4)[a:b])
    assert engine.kv.capture_points(fresh, 0, 101, 101) == (16, 32, 48, 64, 80, 96)
