"""What only a CUDA device runs: CUDA graphs captured and replayed, async scheduling with a real
stream, the compiled Triton kernels inside the engine. Each engine here runs in fp32 with the Triton
kernels; the eager, synchronous engine over the same model is the oracle (and the CPU's torch
kernels the oracle of that). Off a GPU every test here is skipped: the CPU runs of the same code are
tests/test_decode_graphs.py, tests/test_async_scheduling.py and tests/test_kernels.py."""

from __future__ import annotations

import functools

import pytest
import torch

from tests.helpers import SMALL, RecordingEngine, reference, rel_err, tokens
from v4serve.engine.engine import EngineConfig
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.request import Request, SamplingParams
from v4serve.engine.speculative import SpeculativeConfig
from v4serve.kernels.registry import load_kernels

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (none visible to torch)")

BLOCK = tiny_config(**SMALL).block_size
# Prompt lengths on and beside block edges and the window (8), three requests so a step of them is
# padded into the bucket of 4.
LENGTHS = (BLOCK - 1, BLOCK, 2 * BLOCK + 1, 70)


@functools.cache
def cuda_model(mtp: bool = False):
    model = build_tiny(tiny_config(**SMALL, num_nextn_predict_layers=int(mtp)), seed=11).to("cuda")
    model.use_kernels(load_kernels("triton", "cuda"))
    return model


def run(model, requests: list[Request], **config) -> RecordingEngine:
    engine = RecordingEngine(model, EngineConfig(**{"max_model_len": 512, "max_num_seqs": 8, **config}))
    for r in requests:
        engine.add_request(r)
    engine.run_checked()
    engine.close()
    return engine


def greedy_requests(n: int = 12) -> list[Request]:
    return [Request(f"g{i}", tokens(length, seed=i), SamplingParams(max_tokens=n, ignore_eos=True))
            for i, length in enumerate(LENGTHS)]


def assert_same(a: RecordingEngine, b: RecordingEngine, requests_a, requests_b, tol: float = 1e-4) -> None:
    for ra, rb in zip(requests_a, requests_b, strict=True):
        assert ra.output_token_ids == rb.output_token_ids, ra.request_id
        la, lb = torch.stack(a.logits[ra.request_id]), torch.stack(b.logits[rb.request_id])
        assert rel_err(la, lb) < tol, (ra.request_id, rel_err(la, lb))


def test_graphs_are_captured_and_replay_the_eager_steps() -> None:
    model = cuda_model()
    graphs_reqs, eager_reqs = greedy_requests(), greedy_requests()
    graphs = run(model, graphs_reqs)
    eager = run(model, eager_reqs, enforce_eager=True, async_scheduling="off")
    assert graphs.cuda_graphs == "on" and graphs.async_scheduling == "on"
    assert_same(graphs, eager, graphs_reqs, eager_reqs)


def test_eager_cuda_engine_matches_the_cpu_reference() -> None:
    """The compiled kernels inside the engine against the torch kernels on the CPU, one sequence."""
    cpu = build_tiny(tiny_config(**SMALL), seed=11)
    reqs = greedy_requests(8)
    engine = run(cuda_model(), reqs, enforce_eager=True, async_scheduling="off")
    for r in reqs:
        want = reference(cpu, r.prompt_token_ids, r.output_token_ids)
        got = torch.stack(engine.logits[r.request_id]).cpu()
        assert rel_err(got, want) < 1e-3, (r.request_id, rel_err(got, want))


def test_async_scheduling_changes_no_output() -> None:
    """Greedy, seeded sampling, a stop token and max_tokens mid-batch: the overlapped engine gives the
    synchronous engine's tokens, token for token."""
    def requests() -> list[Request]:
        out = greedy_requests()
        out[1].sampling = SamplingParams(max_tokens=5, ignore_eos=True)
        out.append(Request("seeded", tokens(40, seed=9), SamplingParams(max_tokens=16, temperature=0.9, seed=7,
                                                                          ignore_eos=True)))
        return out

    first = requests()
    run(cuda_model(), first)
    stop_at = first[2].output_token_ids[3]
    on, off = requests(), requests()
    for reqs in (on, off):
        reqs[2].sampling = SamplingParams(max_tokens=12, stop_token_ids=[stop_at], ignore_eos=True)
    run(cuda_model(), on)
    run(cuda_model(), off, async_scheduling="off")
    assert [r.output_token_ids for r in on] == [r.output_token_ids for r in off]
    assert len(on[2].output_token_ids) <= 4 and on[2].output_token_ids[-1] == stop_at


def test_prefix_hit_matches_the_cold_run() -> None:
    prompt = tokens(3 * BLOCK + 5, seed=21)
    cold = Request("cold", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    hit = Request("hit", prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine = RecordingEngine(cuda_model(), EngineConfig(max_model_len=512, max_num_seqs=8))
    engine.add_request(cold)
    engine.run_checked()
    engine.add_request(hit)
    engine.run_checked()
    engine.close()
    assert hit.num_cached_tokens > 0
    assert_same(engine, engine, [cold], [hit])


def test_mtp_graphs_replay_the_eager_drafted_passes() -> None:
    model = cuda_model(mtp=True)
    spec = SpeculativeConfig("mtp", 2)
    graphs_reqs, eager_reqs = greedy_requests(16), greedy_requests(16)
    graphs = run(model, graphs_reqs, speculative=spec)
    eager = run(model, eager_reqs, speculative=spec, enforce_eager=True)
    assert graphs.cuda_graphs == "on"
    assert graphs.spec.drafts > 0
    assert_same(graphs, eager, graphs_reqs, eager_reqs)


def test_mtp_graphs_replay_the_eager_drafted_passes_at_a_large_bucket() -> None:
    """Twenty sequences in the bucket of 24 (drafted passes three rows each): the buckets a busy server
    replays, which the four-sequence test above never reaches."""
    model = cuda_model(mtp=True)
    spec = SpeculativeConfig("mtp", 2)

    def requests() -> list[Request]:
        return [Request(f"m{i}", tokens(LENGTHS[i % len(LENGTHS)] + i, seed=40 + i),
                        SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(20)]

    graphs_reqs, eager_reqs = requests(), requests()
    graphs = run(model, graphs_reqs, speculative=spec, max_num_seqs=32)
    eager = run(model, eager_reqs, speculative=spec, enforce_eager=True, max_num_seqs=32)
    assert graphs.cuda_graphs == "on" and graphs.spec.drafts > 0
    assert_same(graphs, eager, graphs_reqs, eager_reqs)


def test_a_bf16_head_is_read_as_stored_and_gives_the_fp32_cast_logits() -> None:
    """A bf16 model's logits come from a bf16 GEMM written in fp32 (no per-step fp32 copy of the head):
    the same logits as the fp32-cast weights, up to the order of the sums."""
    cfg = tiny_config(**SMALL)
    model = build_tiny(cfg, seed=11).to("cuda", torch.bfloat16)
    model.use_kernels(load_kernels("triton", "cuda"))
    h = torch.randn(5, cfg.hc_mult, cfg.hidden_size, device="cuda").bfloat16()
    got = model._logits(h, model)
    x = model.norm(model._hc_head(h, model))
    want = x.float() @ model.head.weight.float().t()
    assert x.dtype == torch.bfloat16 and got.dtype == torch.float32
    assert rel_err(got, want) < 1e-5, rel_err(got, want)
