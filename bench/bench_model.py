"""Prefill and decode tokens/s of the tiny model: v4serve vs transformers on the same weights.

    python bench/bench_model.py [--prompt 1024,4096] [--decode 64] [--repeats 3] [--set KEY=VALUE ...]
                                [--only-batch-invariant]

Also the cost of --batch-invariant: torch-backend decode tokens/s through the engine at batch 1
and 16, default kernels vs the batch-invariant set (`--only-batch-invariant` measures only that).

`--set` sizes the model as `v4serve make-checkpoint --set` does, e.g. the 30M-parameter config:
--set hidden_size=256 --set num_heads=8 --set 'compress_ratios=[0,0,4,128,4,128,4,128]'
--set n_routed_experts=16 --set moe_intermediate_size=256 --set q_lora_rank=128 --set o_lora_rank=128
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import decode_seconds, interleaved, print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.parallel.single import SingleSequence  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.kernels.registry import load_kernels  # noqa: E402
from v4serve.server.cli import _parse_override  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt", default="1024,4096", help="prompt lengths for prefill")
    parser.add_argument("--decode", type=int, default=64, help="decode steps after a 512-token prompt")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--set", type=_parse_override, action="append", metavar="KEY=VALUE", default=[])
    parser.add_argument("--only-batch-invariant", action="store_true", help="only the --batch-invariant cost")
    args = parser.parse_args()

    overrides = dict(args.set)
    if "compress_ratios" in overrides:
        overrides["compress_ratios"] = tuple(overrides["compress_ratios"])
        overrides.setdefault("num_layers", len(overrides["compress_ratios"]))
    model = build_tiny(tiny_config(**overrides))
    params = sum(p.numel() for p in model.parameters())
    invariance = batch_invariance_cost(model, args.repeats)
    if args.only_batch_invariant:
        write_results("bench_model", {"parameters": params, "batch_invariant": invariance})
        return

    import transformers

    folder = write_checkpoint(model, Path(tempfile.mkdtemp(prefix="bench-tiny-")))
    ours = load_model(folder, progress=False)
    ours.use_kernels(load_kernels("torch"))  # as `serve` runs it on a CPU (projections fused)
    hf = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    vocab = ours.cfg.vocab_size
    torch.set_num_threads(os.cpu_count() or 1)  # prefill as the engine runs it: every core
    gen = torch.Generator().manual_seed(0)
    rows, results = [], {"prefill": [], "decode": {}}

    for n in [int(x) for x in args.prompt.split(",")]:
        ids = torch.randint(0, vocab, (n,), generator=gen)

        def run_ours(ids=ids) -> None:
            SingleSequence(ours, len(ids)).step(ids.tolist())

        def run_hf(ids=ids) -> None:
            with torch.no_grad():
                hf(ids[None], logits_to_keep=1)

        t = interleaved({"v4serve": run_ours, "transformers": run_hf}, args.repeats)
        ours_tps, hf_tps = n / t["v4serve"], n / t["transformers"]
        rows.append([f"prefill {n}", ours_tps, hf_tps, ours_tps / hf_tps])
        results["prefill"].append({"tokens": n, "v4serve_tok_s": ours_tps, "transformers_tok_s": hf_tps})

    prompt = torch.randint(0, vocab, (512,), generator=gen)
    steps = torch.randint(0, vocab, (args.decode * args.repeats,), generator=gen).tolist()
    ours_ms, hf_ms = decode_step_ms(ours, hf, prompt.tolist(), steps)
    rows.append([f"decode {len(steps)} from 512", 1e3 / ours_ms, 1e3 / hf_ms, hf_ms / ours_ms])
    results["decode"] = {"steps": len(steps), "context": 512, "v4serve_tok_s": 1e3 / ours_ms,
                         "transformers_tok_s": 1e3 / hf_ms, "threads": DECODE_THREADS}

    results["parameters"] = params
    results["batch_invariant"] = invariance
    print_table(f"{params / 1e6:.1f}M-parameter model, batch 1, fp32 CPU, prefill on every core, decode on one "
                "(tokens/s; ratio = v4serve / transformers)",
                ["workload", "v4serve", "transformers", "ratio"], rows)
    write_results("bench_model", results)


DECODE_THREADS = 1


def decode_step_ms(ours: DeepseekV4, hf: Any, prompt: list[int], steps: list[int]) -> tuple[float, float]:
    """Median milliseconds of one decode step of each model after the same prompt, teacher-forced
    through the same tokens, on one intra-op thread (as the engine runs a decode step; more only
    slows either model here). The two step in turns (one token of each, then the next), so a
    shared machine's changing speed lands on both alike; the prefills are not timed."""
    threads = torch.get_num_threads()
    seq = SingleSequence(ours, len(prompt) + len(steps))
    seq.step(prompt)
    with torch.no_grad():
        cache = hf(torch.tensor([prompt]), use_cache=True, logits_to_keep=1).past_key_values
        torch.set_num_threads(DECODE_THREADS)
        ours_ms, hf_ms = [], []
        try:
            for tok in steps:
                t0 = time.perf_counter()
                seq.step([tok])
                t1 = time.perf_counter()
                cache = hf(torch.tensor([[tok]]), past_key_values=cache, use_cache=True).past_key_values
                ours_ms.append((t1 - t0) * 1e3)
                hf_ms.append((time.perf_counter() - t1) * 1e3)
        finally:
            torch.set_num_threads(threads)
    return statistics.median(ours_ms), statistics.median(hf_ms)


# Decode cost of --batch-invariant: a short context keeps the attention share small, so the table
# shows mostly what per-row projections cost.
INVARIANCE_CONTEXT, INVARIANCE_STEPS = 128, 16


def decode_tok_s(model: DeepseekV4, batch: int) -> float:
    """Decode tokens/s of `batch` requests through the engine, timed after every prefill is done."""
    engine = LLMEngine(model, EngineConfig(max_model_len=1024, max_num_seqs=batch, enable_prefix_caching=False))
    gen = torch.Generator().manual_seed(batch)
    reqs = [Request(f"r{i}", torch.randint(64, model.cfg.vocab_size, (INVARIANCE_CONTEXT,), generator=gen).tolist(),
                    SamplingParams(max_tokens=INVARIANCE_STEPS + 1, ignore_eos=True)) for i in range(batch)]
    return batch * INVARIANCE_STEPS / decode_seconds(engine, reqs)


def batch_invariance_cost(model: DeepseekV4, repeats: int) -> list[dict[str, float]]:
    """Torch-backend decode tokens/s at batch 1 and 16, default kernels vs --batch-invariant."""
    kernels = {"default": load_kernels("torch"), "batch_invariant": load_kernels("torch", batch_invariant=True)}
    rows, results = [], []
    for batch in (1, 16):
        def timed(name: str, batch: int = batch) -> float:
            model.use_kernels(kernels[name])
            return decode_tok_s(model, batch)

        best = {name: max(timed(name) for _ in range(repeats)) for name in kernels}
        ratio = best["batch_invariant"] / best["default"]
        rows.append([f"decode batch {batch}", best["default"], best["batch_invariant"], ratio])
        results.append({"batch": batch, "context": INVARIANCE_CONTEXT, "default_tok_s": best["default"],
                        "batch_invariant_tok_s": best["batch_invariant"], "ratio": ratio})
    model.use_kernels(kernels["default"])
    print_table("--batch-invariant cost, torch backend, fp32 CPU (tokens/s; ratio = invariant / default)",
                ["workload", "default", "batch-invariant", "ratio"], rows)
    return results


if __name__ == "__main__":
    main()
