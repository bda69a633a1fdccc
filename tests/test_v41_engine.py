"""The engine serving DeepSeek-V4.1 (the embedded `tiny-v41`): requests in, tokens out, through the
State and Block Cache. Greedy decisions equal the dense reference (the prompt whole, then one token at
a time); a prefix hit in every SWA mode, at a block edge and off by one each side, gives the cold run's
tokens and logits and never writes the hit's blocks; what V4.1 cannot do yet is refused by name.

With V4.1's KV rounding on, a hit is bitwise the cold run where it computes the same chunks (zero mode
recomputes from the start here); elsewhere a last-bit difference between chunkings can cross a
rounding bin, so the modes that restore a snapshot are checked with the rounding off (fp32 noise)."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import engine_for, greedy, rel_err, tokens, v41_rounding_off
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.model.v41.model import DeepseekV41
from v4serve.engine.model.v41.tiny import build_tiny_v41
from v4serve.engine.speculative import SpeculativeConfig
from v4serve.kernels.registry import load_kernels
from v4serve.server.text.engram_map import folded_vocabulary
from v4serve.server.text.tokenizer import ByteTokenizer

BLOCK = 128


@pytest.fixture(scope="module")
def model() -> DeepseekV41:
    return build_tiny_v41(folded_vocabulary(ByteTokenizer().vocabulary_json()))


@pytest.fixture
def no_rounding(monkeypatch: pytest.MonkeyPatch) -> None:
    v41_rounding_off(monkeypatch)


def reference(model: DeepseekV41, prompt: list[int], outputs: list[int]) -> torch.Tensor:
    """Each decision's logits in private dense KV: the prompt whole, then the chosen tokens one by one."""
    ids, back = torch.tensor(prompt + outputs), model.context_tokens
    kv = model.new_sequence()
    rows = [model.run_sequence(ids[:len(prompt)], len(prompt), kv)[-1]]
    for at in range(len(prompt), len(prompt) + len(outputs) - 1):
        rows.append(model.run_sequence(ids[at - back:at + 1], 1, kv)[-1])
    return torch.stack(rows)


def test_greedy_decisions_are_the_dense_models(model: DeepseekV41) -> None:
    engine = engine_for(model)
    prompt = tokens(300, 1)
    out = engine.generate([greedy("a", prompt, n=8)])["a"]
    ref = reference(model, prompt, out)
    assert out == ref.argmax(-1).tolist()
    assert rel_err(torch.stack(engine.logits["a"]), ref) <= 1e-5
    engine.check()


def test_chunked_prefill_and_a_batch_of_requests(model: DeepseekV41, no_rounding: None) -> None:
    """Chunks of 100 (crossing the window and the block) and three requests stepping together."""
    prompts = [tokens(260, 10 + i) for i in range(3)]
    engine = engine_for(model, max_prefill_chunk=100, max_num_batched_tokens=150)
    outs = engine.generate([greedy(f"r{i}", p) for i, p in enumerate(prompts)])
    for i, prompt in enumerate(prompts):
        ref = reference(model, prompt, outs[f"r{i}"])
        assert outs[f"r{i}"] == ref.argmax(-1).tolist()
        assert rel_err(torch.stack(engine.logits[f"r{i}"]), ref) <= 1e-4
    engine.check()


def _pair(model: DeepseekV41, mode: str, shared: int) -> tuple[list[int], list[int]]:
    base = tokens(shared, 3)
    a, b = tokens(9, 4), tokens(9, 5)
    b[0] = a[0] + 1 if a[0] < 319 else a[0] - 1
    return base + a, base + b


def _hit_and_cold(model: DeepseekV41, mode: str, shared: int) -> tuple[object, list[int], list[int], object]:
    first, second = _pair(model, mode, shared)
    engine = engine_for(model, swa_cache_mode=mode)
    engine.generate([greedy("first", first)])
    before = [t.clone() for t in engine.device_kv.layers[2].block_tensors()]
    req = greedy("second", second)
    out = engine.generate([req])["second"]
    engine.check()
    cold = engine_for(model, enable_prefix_caching=False)
    cold_out = cold.generate([greedy("cold", second)])["cold"]
    hit = min(shared, len(second) - 1) // BLOCK * BLOCK
    assert req.num_hit_tokens == hit
    blocks = req.kv.block_table[:hit // BLOCK]
    for old, now in zip(before, engine.device_kv.layers[2].block_tensors(), strict=True):
        assert torch.equal(old[blocks], now[blocks]), "a hit's blocks are read, never written"
    assert out == cold_out, "a cache hit must give the cold run's greedy tokens"
    return engine, out, cold_out, cold


@pytest.mark.parametrize("mode", ["full", "periodic", "zero"])
@pytest.mark.parametrize("shared", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1])
def test_a_hit_equals_the_cold_run(model: DeepseekV41, mode: str, shared: int, no_rounding: None) -> None:
    engine, _, _, cold = _hit_and_cold(model, mode, shared)
    assert rel_err(torch.stack(engine.logits["second"]), torch.stack(cold.logits["cold"])) <= 1e-4


@pytest.mark.parametrize("shared", [BLOCK, 2 * BLOCK + 1])
def test_with_kv_rounding_a_zero_mode_hit_is_bitwise_the_cold_run(model: DeepseekV41, shared: int) -> None:
    engine, _, _, cold = _hit_and_cold(model, "zero", shared)
    assert torch.equal(torch.stack(engine.logits["second"]), torch.stack(cold.logits["cold"]))


@pytest.mark.parametrize(("config", "says"), [
    (EngineConfig(kv_cache_dtype="fp8"), "--kv-cache-dtype fp8"),
    (EngineConfig(speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=2)), "DSpark"),
])
def test_what_v41_does_not_do_yet_is_refused_by_name(model: DeepseekV41, config: EngineConfig, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        LLMEngine(model, config)


def test_batch_invariance_is_refused_by_name() -> None:
    model = build_tiny_v41(folded_vocabulary(ByteTokenizer().vocabulary_json()))
    model.use_kernels(load_kernels("torch", batch_invariant=True))
    with pytest.raises(ValueError, match="--batch-invariant"):
        LLMEngine(model, EngineConfig())


@pytest.mark.parametrize("mode", ["zero", "periodic"])
def test_a_disk_hit_after_a_restart_equals_the_cold_run(model: DeepseekV41, mode: str, tmp_path: object,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The SSD store's files carry V4.1's blocks and slot snapshots: a fresh engine reads them back."""
    if mode == "periodic":  # it restores a snapshot, then computes another chunk than the cold run's
        v41_rounding_off(monkeypatch)
    prompt = tokens(2 * BLOCK + 20, 7)
    first = engine_for(model, kv_store_dir=str(tmp_path), swa_cache_mode=mode)
    first.generate([greedy("first", prompt)])
    first.close()
    again = engine_for(model, kv_store_dir=str(tmp_path), swa_cache_mode=mode, kv_store_read_timeout=60.0)
    req = greedy("again", prompt)
    out = again.generate([req])["again"]
    again.check()
    again.close()
    assert req.num_disk_hit_tokens == 2 * BLOCK
    cold = engine_for(model, enable_prefix_caching=False)
    assert out == cold.generate([greedy("cold", prompt)])["cold"]
    if mode == "zero":
        assert torch.equal(torch.stack(again.logits["again"]), torch.stack(cold.logits["cold"]))
    else:
        assert rel_err(torch.stack(again.logits["again"]), torch.stack(cold.logits["cold"])) <= 1e-4
