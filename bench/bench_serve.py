"""Serving throughput through HTTP: output tokens/s and time to first token at several
concurrencies on the tiny model, against transformers' `generate` on the same weights (batch =
concurrency). Target: at concurrency 16, v4serve's output throughput ≥ 6× its concurrency-1
throughput.

    python bench/bench_serve.py [--concurrency 1,4,16] [--prompt 256] [--output 64]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import daemon  # noqa: E402


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], output: int) -> tuple[float, int]:
    body = {"prompt": prompt, "max_tokens": output, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0}
    t0 = time.perf_counter()
    ttft, tokens = None, 0
    async with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            n = len((choice.get("logprobs") or {}).get("tokens", []))
            if n and ttft is None:
                ttft = time.perf_counter() - t0
            tokens += n
    return ttft or 0.0, tokens


async def load(url: str, concurrency: int, prompts: list[list[int]], output: int) -> dict[str, float]:
    sem = asyncio.Semaphore(concurrency)
    async with httpx.AsyncClient(timeout=600) as client:
        async def run(p: list[int]) -> tuple[float, int]:
            async with sem:
                return await one_request(client, url, p, output)

        t0 = time.perf_counter()
        results = await asyncio.gather(*(run(p) for p in prompts))
        elapsed = time.perf_counter() - t0
    tokens = sum(n for _, n in results)
    return {"output_tok_s": tokens / elapsed, "ttft_p50_s": statistics.median(t for t, _ in results),
            "tokens": tokens, "seconds": elapsed}


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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=2, help="requests per client")
    args = parser.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    gen = torch.Generator().manual_seed(0)

    from v4serve.engine.model.checkpoint import write_checkpoint
    from v4serve.engine.model.tiny import build_tiny

    folder = write_checkpoint(build_tiny(), Path(tempfile.mkdtemp(prefix="bench-serve-")))
    ours: dict[int, dict[str, float]] = {}
    with daemon("--model", "tiny", "--max-num-seqs", str(max(levels)), "--no-prefix-caching") as url:
        asyncio.run(load(url, 2, [torch.randint(64, 320, (32,), generator=gen).tolist()] * 2, 4))  # warm-up
        for c in levels:
            prompts = [torch.randint(64, 320, (args.prompt,), generator=gen).tolist() for _ in range(c * args.rounds)]
            ours[c] = asyncio.run(load(url, c, prompts, args.output))
    theirs = {c: transformers_baseline(folder, c, args.prompt, args.output, gen) for c in levels}

    base = ours[levels[0]]["output_tok_s"]
    rows = [[c, ours[c]["output_tok_s"], theirs[c]["output_tok_s"], ours[c]["output_tok_s"] / theirs[c]["output_tok_s"],
             ours[c]["output_tok_s"] / base, ours[c]["ttft_p50_s"], theirs[c]["ttft_p50_s"]] for c in levels]
    print_table(f"tiny model through HTTP, {args.prompt}-token prompts, {args.output} output tokens "
                "(tok/s; ratio = v4serve / transformers; scaling = v4serve / its concurrency-1)",
                ["concurrency", "v4serve tok/s", "transformers tok/s", "ratio", "scaling", "v4serve TTFT",
                 "transformers TTFT"], rows)
    top = max(levels)
    target = ours[top]["output_tok_s"] / base
    print(f"\nconcurrency {top} / concurrency {levels[0]} throughput: {target:.1f}x (target >= 6x)")
    write_results("bench_serve", {"prompt": args.prompt, "output": args.output,
                                  "v4serve": {str(c): v for c, v in ours.items()},
                                  "transformers": {str(c): v for c, v in theirs.items()},
                                  "scaling_top_over_first": target})


if __name__ == "__main__":
    main()
