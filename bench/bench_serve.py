"""Serving throughput through HTTP, in two tables.

1. The front end's cost (the 30M-parameter config unless `--set` says otherwise): HTTP output
   tokens/s at concurrency 1/4/16 with the engine in its own process (the default: "after") and on
   a thread of the HTTP process (`--engine-in-process`, how v4serve ran before the split:
   "before"), each as a ratio to the engine's decode rate at the same batch size, measured in the
   same run by driving `LLMEngine` directly on the same checkpoint; TTFT p50/p99. Goal: at
   concurrency 16 the engine process keeps >= 0.9 of the engine's rate. With long prompts the HTTP
   rate includes every prefill and the decode rate does not: the "/ e2e" columns compare with the
   same requests run on the engine directly, prefill included.
2. The tiny model against transformers' `generate` on the same weights (batch = concurrency).
   Target: at concurrency 16, v4serve's output throughput >= 6x its concurrency-1 throughput.

    python bench/bench_serve.py [--concurrency 1,4,16] [--prompt 16] [--output 192] [--rounds 2]
                                [--repeats 2] [--set KEY=VALUE ...] [--skip-transformers]

The HTTP clients run in this process on the same cores as the daemon; they read only the first
token's chunk and the usage chunk of each stream, so they cost the daemon as little as they can.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import decode_seconds, print_table, write_results  # noqa: E402
from tests.daemon import daemon  # noqa: E402
from v4serve.engine.engine import LLMEngine  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.model.weights.checkpoint import write_checkpoint  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.server.cli import _parse_override  # noqa: E402
from v4serve.server.config import ServeConfig  # noqa: E402
from v4serve.server.model_loading import engine_config, load  # noqa: E402
from v4serve.server.text.tokenizer import write_byte_tokenizer_files  # noqa: E402

# bench/bench_model.py's 30M-parameter config.
MODEL_30M = {"hidden_size": 256, "num_heads": 8, "compress_ratios": [0, 0, 4, 128, 4, 128, 4, 128],
             "n_routed_experts": 16, "moe_intermediate_size": 256, "q_lora_rank": 128, "o_lora_rank": 128}


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100)."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def latency(ttfts: list[float]) -> dict[str, float]:
    return {"ttft_p50_s": statistics.median(ttfts), "ttft_p99_s": percentile(ttfts, 99)}


# ---- HTTP ------------------------------------------------------------------------------------------
async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], output: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if ttft is None and line.startswith('data: {"id"'):
                ttft = time.perf_counter() - t0
            elif line.startswith("data: ") and '"usage": {' in line:
                usage = json.loads(line[6:])["usage"]
                tokens = usage["completion_tokens"] if usage else tokens
    return ttft or 0.0, tokens


async def http_load(url: str, concurrency: int, prompts: list[list[int]], output: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(p: list[int]) -> tuple[float, int]:
            async with sem:
                return await one_request(client, url, p, output)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    tokens, ttfts = sum(n for _, n in results), [t for t, _ in results]
    return {"output_tok_s": tokens / elapsed, **latency(ttfts), "ttfts": ttfts, "tokens": tokens, "seconds": elapsed}


# ---- the engine driven directly -------------------------------------------------------------------------
def engine_decode(engine: LLMEngine, batch: int, prompts: list[list[int]], output: int) -> float:
    """Decode tokens/s of `batch` requests, timed once every prompt has its first token."""
    reqs = [Request(f"d{batch}-{i}", p, SamplingParams(max_tokens=output, ignore_eos=True))
            for i, p in enumerate(prompts[:batch])]
    return batch * (output - 1) / decode_seconds(engine, reqs)


def engine_end_to_end(engine: LLMEngine, batch: int, prompts: list[list[int]], output: int) -> float:
    """Output tokens/s of the HTTP workload run on the engine directly, `batch` requests at a time,
    prefill included: with long prompts the fair reference for the front end's own cost."""
    params = SamplingParams(max_tokens=output, ignore_eos=True)
    t0, tokens = time.perf_counter(), 0
    for start in range(0, len(prompts), batch):
        reqs = [Request(f"e{batch}-{start + i}", p, params) for i, p in enumerate(prompts[start:start + batch])]
        tokens += sum(len(out) for out in engine.generate(reqs).values())
    return tokens / (time.perf_counter() - t0)


def front_end_cost(folder: Path, levels: list[int], args: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """Per concurrency, in turns (engine, before, after; `--repeats` times, so drift from a shared
    machine lands on all three alike): medians of tok/s, TTFT percentiles over every request."""
    gen = torch.Generator().manual_seed(1)
    workloads = {c: [torch.randint(64, vocab, (args.prompt,), generator=gen).tolist()
                     for _ in range(c * args.rounds)] for c in levels}
    warm = [torch.randint(64, vocab, (16,), generator=gen).tolist()] * 2
    flags = ("--model", str(folder), "--max-num-seqs", str(max(levels)), "--no-prefix-caching")
    cfg = ServeConfig(model=str(folder), max_num_seqs=max(levels), no_prefix_caching=True, no_kv_store=True)
    model: DeepseekV4 = load(cfg)  # as the daemon loads it: same weights, dtype and kernels
    engine = LLMEngine(model, engine_config(cfg, model, None))
    engine_decode(engine, 2, warm, 4)

    modes = ("before", "after")  # --engine-in-process, then the engine process
    runs: dict[str, dict[int, list[dict[str, Any]]]] = {m: {c: [] for c in levels} for m in modes}
    decode: dict[int, list[float]] = {c: [] for c in levels}
    end_to_end: dict[int, list[float]] = {c: [] for c in levels}
    with daemon(*flags, "--engine-in-process", timeout=180) as before, daemon(*flags, timeout=180) as after:
        urls = {"before": before, "after": after}
        for url in urls.values():
            asyncio.run(http_load(url, 2, warm, 4))
        for c in levels:
            for _ in range(args.repeats):
                decode[c].append(engine_decode(engine, c, workloads[c], args.output))
                end_to_end[c].append(engine_end_to_end(engine, c, workloads[c], args.output))
                for mode in modes:
                    runs[mode][c].append(asyncio.run(http_load(urls[mode], c, workloads[c], args.output)))

    results: dict[str, Any] = {"engine_decode_tok_s": {}, "engine_end_to_end_tok_s": {}, **{m: {} for m in modes}}
    rows = []
    for c in levels:
        engine_rate, whole = statistics.median(decode[c]), statistics.median(end_to_end[c])
        results["engine_decode_tok_s"][str(c)] = engine_rate
        results["engine_end_to_end_tok_s"][str(c)] = whole
        row: list[Any] = [c, engine_rate, whole]
        for mode in modes:
            rate = statistics.median(r["output_tok_s"] for r in runs[mode][c])
            ttfts = [t for r in runs[mode][c] for t in r["ttfts"]]
            results[mode][str(c)] = {"output_tok_s": rate, "ratio_to_engine": rate / engine_rate,
                                     "ratio_to_engine_end_to_end": rate / whole, **latency(ttfts),
                                     "runs": [r["output_tok_s"] for r in runs[mode][c]]}
            row += [rate, rate / engine_rate, rate / whole]
        row += [results[m][str(c)][k] for k in ("ttft_p50_s", "ttft_p99_s") for m in modes]
        rows.append(row)
    print_table(f"front end vs engine, {args.prompt}-token prompts, {args.output} output tokens, {args.rounds} "
                f"requests per client, median of {args.repeats} (tok/s; ratio = HTTP / engine decode at that batch; "
                "/ e2e = HTTP / the same requests on the engine directly, prefill included; "
                "before = --engine-in-process, after = engine process)",
                ["conc", "engine decode", "engine e2e", "before tok/s", "before ratio", "before / e2e", "after tok/s",
                 "after ratio", "after / e2e", "TTFT p50 before", "p50 after", "p99 before", "p99 after"], rows)
    after, before = (results[m][str(max(levels))]["ratio_to_engine"] for m in ("after", "before"))
    print(f"\nconcurrency {max(levels)}: the engine process keeps {after:.2f} of the engine's decode rate "
          f"(goal >= 0.9); the in-process engine kept {before:.2f}")
    return results


# ---- tiny model vs transformers ---------------------------------------------------------------------------
def transformers_baseline(folder: Path, batch: int, prompt_len: int, output: int, gen: torch.Generator
                          ) -> dict[str, float]:
    import transformers

    model = transformers.DeepseekV4ForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(64, 320, (batch, prompt_len), generator=gen)
    kwargs = dict(do_sample=False, pad_token_id=2, eos_token_id=None)
    with torch.no_grad():
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, min_new_tokens=1, **kwargs)
        ttft = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=output, min_new_tokens=output, **kwargs)
        elapsed = time.perf_counter() - t0
    return {"output_tok_s": batch * output / elapsed, "ttft_p50_s": ttft}


def against_transformers(levels: list[int], rounds: int) -> dict[str, Any]:
    prompt_len, output = 256, 64
    gen = torch.Generator().manual_seed(0)
    folder = write_checkpoint(build_tiny(), Path(tempfile.mkdtemp(prefix="bench-serve-")))
    ours: dict[int, dict[str, float]] = {}
    with daemon("--model", "tiny", "--max-num-seqs", str(max(levels)), "--no-prefix-caching") as url:
        asyncio.run(http_load(url, 2, [torch.randint(64, 320, (32,), generator=gen).tolist()] * 2, 4))  # warm-up
        for c in levels:
            prompts = [torch.randint(64, 320, (prompt_len,), generator=gen).tolist() for _ in range(c * rounds)]
            ours[c] = asyncio.run(http_load(url, c, prompts, output))
    theirs = {c: transformers_baseline(folder, c, prompt_len, output, gen) for c in levels}

    base = ours[levels[0]]["output_tok_s"]
    rows = [[c, ours[c]["output_tok_s"], theirs[c]["output_tok_s"], ours[c]["output_tok_s"] / theirs[c]["output_tok_s"],
             ours[c]["output_tok_s"] / base, ours[c]["ttft_p50_s"], theirs[c]["ttft_p50_s"]] for c in levels]
    print_table(f"tiny model through HTTP, {prompt_len}-token prompts, {output} output tokens "
                "(tok/s; ratio = v4serve / transformers; scaling = v4serve / its concurrency-1)",
                ["concurrency", "v4serve tok/s", "transformers tok/s", "ratio", "scaling", "v4serve TTFT",
                 "transformers TTFT"], rows)
    top = max(levels)
    target = ours[top]["output_tok_s"] / base
    print(f"\nconcurrency {top} / concurrency {levels[0]} throughput: {target:.1f}x (target >= 6x)")
    return {"prompt": prompt_len, "output": output, "v4serve": {str(c): v for c, v in ours.items()},
            "transformers": {str(c): v for c, v in theirs.items()}, "scaling_top_over_first": target}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16")
    # Short prompts, long outputs: the HTTP rate is then mostly decode, comparable to the engine's.
    parser.add_argument("--prompt", type=int, default=16, help="prompt tokens (front-end table)")
    parser.add_argument("--output", type=int, default=192, help="output tokens (front-end table)")
    parser.add_argument("--rounds", type=int, default=2, help="requests per client")
    parser.add_argument("--repeats", type=int, default=2, help="turns of engine / before / after per concurrency")
    parser.add_argument("--set", type=_parse_override, action="append", metavar="KEY=VALUE", default=[],
                        help="model size for the front-end table (default: the 30M-parameter config)")
    parser.add_argument("--skip-transformers", action="store_true", help="only the front-end table")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]

    overrides = {**MODEL_30M, **dict(args.set)} if not args.set else dict(args.set)
    if "compress_ratios" in overrides:
        overrides["compress_ratios"] = tuple(overrides["compress_ratios"])
        overrides.setdefault("num_layers", len(overrides["compress_ratios"]))
    sized = build_tiny(tiny_config(**overrides))
    params = sum(p.numel() for p in sized.parameters())
    folder = write_checkpoint(sized, Path(tempfile.mkdtemp(prefix="bench-serve-30m-")))
    write_byte_tokenizer_files(folder)
    print(f"front-end table: {params / 1e6:.1f}M parameters, {sized.cfg.num_layers} layers")
    results: dict[str, Any] = {"front_end": {"parameters": params, "prompt": args.prompt, "output": args.output,
                                             "rounds": args.rounds,
                                             **front_end_cost(folder, levels, args, sized.cfg.vocab_size)}}
    if not args.skip_transformers:
        results["tiny_vs_transformers"] = against_transformers(levels, rounds=2)
    write_results("bench_serve", results)


if __name__ == "__main__":
    main()
