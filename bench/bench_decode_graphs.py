"""Decode through the engine with and without CUDA graphs, side by side: the part of
`bench/gpu_check.sh` that times what `--enforce-eager` turns off.

For each batch size, the same greedy requests (random prompts, `--steps` new tokens each) run
through an `LLMEngine` built twice over one model: graphs (the default on CUDA) and
`enforce_eager=True`. Each engine step that only decodes is timed (the step returns after the
sampled ids are back on the host, so the wall clock covers the device work); the table gives the
median ms per decode step of each and their ratio (eager / graphs: above 1, the graphs are
faster), and whether the two produced the same tokens (greedy: they should, up to near-ties).
With `--speculative none,mtp` the same runs again with the model's MTP layer drafting two tokens a
pass (a random layer here, so most drafts are rejected and drafting pauses between; the drafted passes
still run), which times the drafted passes' and the MTP layer's graphs against eager.
Written to bench/results/bench_decode_graphs.json.

    .venv/bin/python bench/bench_decode_graphs.py [--device cuda] [--batches 1,8,32] [--steps 32] [--smoke]
        [--speculative none,mtp] [--dtype bfloat16|float32]

The model has the real attention shapes of bench_gpu.py (4 layers, bf16 on CUDA); `--smoke` shrinks
it so the script can be tested on a CPU (always fp32), where graphs are off (the engine says why) and both columns
are eager.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_gpu import REAL, SMOKE  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.engine.speculative import SpeculativeConfig  # noqa: E402
from v4serve.kernels.registry import load_kernels  # noqa: E402


def decode_steps(engine: LLMEngine, prompts: list[list[int]], steps: int) -> tuple[list[float], list[list[int]]]:
    """Run the prompts to `steps` new tokens each → (seconds of each decode-only step, the tokens)."""
    requests = [Request(f"r{i}", p, SamplingParams(max_tokens=steps, ignore_eos=True)) for i, p in enumerate(prompts)]
    for r in requests:
        engine.add_request(r)
    times = []
    while engine.has_work():
        decoding = all(r.num_computed_tokens >= r.num_prompt_tokens for r in requests if r.finish_reason is None)
        start = time.perf_counter()
        engine.step()
        if decoding:
            times.append(time.perf_counter() - start)
    return times, [r.output_token_ids for r in requests]


def first_difference(a: list[list[int]], b: list[list[int]]) -> tuple[int, int] | None:
    """(request, token index) of the first token where two runs part, fewest tokens in first; None if none."""
    parts = [(i, next(k for k in range(len(x) + 1) if k == len(x) or k == len(y) or x[k] != y[k]))
             for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return min(parts, key=lambda p: p[1]) if parts else None


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--prompt", type=int, default=256, help="prompt tokens per request")
    parser.add_argument("--speculative", default="none", help="comma-separated: none, mtp")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"],
                        help="on CUDA (fp32 tells a bug from a bf16 near-tie where the tokens differ)")
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    methods = args.speculative.split(",")
    if not set(methods) <= {"none", "mtp"}:
        parser.error(f"--speculative takes none and mtp, got {args.speculative}")
    cfg = tiny_config(**(SMOKE if args.smoke else REAL), num_nextn_predict_layers=int("mtp" in methods))
    dtype = getattr(torch, args.dtype) if args.device == "cuda" else torch.float32
    model = build_tiny(cfg, seed=0).to(args.device, dtype)
    model.use_kernels(load_kernels("triton" if args.device == "cuda" else "torch", args.device))
    rows, results = [], {"device": args.device, "batches": {}, "drafted": {}}
    for method in methods:
        gen = torch.Generator().manual_seed(0)
        spec = None if method == "none" else SpeculativeConfig(method, 2)
        for batch in batches:
            prompts = [torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist() for _ in range(batch)]
            measured = {}
            for mode in ("graphs", "eager", "graphs, async off")[:2 + (spec is None)]:
                config = EngineConfig(max_num_seqs=max(batches), max_model_len=args.prompt + args.steps + 64,
                                      kv_dtype=dtype, enable_prefix_caching=False, enforce_eager=mode == "eager",
                                      speculative=spec, async_scheduling="off" if "async off" in mode else "auto")
                engine = LLMEngine(model, config)
                times, tokens = decode_steps(engine, prompts, args.steps)
                measured[mode] = {"cuda_graphs": engine.cuda_graphs, "async_scheduling": engine.async_scheduling,
                                  "median_s": statistics.median(times),
                                  "steps": len(times), "drafted_passes": engine.spec.drafts, "tokens": tokens}
                engine.close()
            g, e = measured["graphs"], measured["eager"]
            s = measured.get("graphs, async off", g)
            same = g["tokens"] == e["tokens"] == s["tokens"]
            row = {**{m: {k: v for k, v in measured[m].items() if k != "tokens"} for m in measured},
                   "ratio_eager_over_graphs": e["median_s"] / g["median_s"],
                   "ratio_sync_over_async": s["median_s"] / g["median_s"], "same_tokens": same,
                   "first_difference": first_difference(g["tokens"], e["tokens"])}
            (results["batches"] if spec is None else results["drafted"].setdefault(method, {}))[batch] = row
            rows.append([method, batch, g["cuda_graphs"], g["async_scheduling"], g["drafted_passes"],
                         f"{g['median_s'] * 1e3:.2f}", f"{e['median_s'] * 1e3:.2f}",
                         f"{e['median_s'] / g['median_s']:.2f}",
                         f"{s['median_s'] / g['median_s']:.2f}" if s is not g else "-",
                         "yes" if same else f"no (first at {row['first_difference']})"])
    print_table(f"decode through the engine on {args.device} ({dtype}), {cfg.num_layers} layers, prompt {args.prompt}, "
                f"{args.steps} steps (median ms per decode step; drafts: passes with drafts, two each)",
                ["drafts", "batch", "graphs", "async scheduling", "drafted passes", "graphs ms", "eager ms",
                 "eager / graphs", "async off / on", "same tokens"], rows)
    write_results("bench_decode_graphs", results)
    return results


if __name__ == "__main__":
    main()
