"""KV cache memory and prefix-reuse savings on the tiny model.

1. Memory per request at several context lengths: State Cache bytes (constant), Block Cache
   bytes (blocks actually taken, against the theoretical bytes per token), and what a uniform
   paged layout (one uncompressed KV entry per token per layer) would need.
2. A repeated long prompt (a document, then a different question) per SWA caching mode:
   prefill tokens skipped, tokens recomputed, time to first token cold vs hit.

    python bench/bench_cache.py [--contexts 8192,32768,131072] [--doc 8192]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_to_first_token, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(64, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def memory_rows(model, contexts: list[int]) -> tuple[list[list], list[dict]]:
    rows, out = [], []
    for n in contexts:
        engine = LLMEngine(model, EngineConfig(max_model_len=n + 8, max_num_seqs=1, enable_prefix_caching=False,
                                               max_num_batched_tokens=2048, max_prefill_chunk=2048))
        req = Request("m", prompt(n, 1), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.add_request(req)
        while not req.output_token_ids:
            engine.step()
        layout, itemsize = engine.layout, engine.device_kv.dtype.itemsize
        state = engine.device_kv.slot_nbytes()
        blocks = len(req.kv.block_table) * layout.block_bytes(itemsize)
        theory = layout.block_bytes(itemsize) / layout.block_size * req.num_computed_tokens
        paged = layout.paged_bytes_per_token(itemsize) * req.num_computed_tokens
        engine.abort("m")
        rows.append([n, state, blocks, theory, paged, paged / (state + blocks)])
        out.append({"context": n, "state_cache_bytes": state, "block_cache_bytes": blocks,
                    "block_cache_theoretical_bytes": theory, "uniform_paged_bytes": paged,
                    "paged_over_v4serve": paged / (state + blocks)})
    return rows, out


def reuse_rows(model, doc_len: int) -> tuple[list[list], list[dict]]:
    doc = prompt(doc_len, 2)
    q1, q2 = prompt(24, 3), prompt(24, 4)
    rows, out = [], []
    for mode in ("full", "periodic", "zero"):
        engine = LLMEngine(model, EngineConfig(max_model_len=doc_len + 64, max_num_seqs=2, swa_cache_mode=mode,
                                               max_num_batched_tokens=2048, max_prefill_chunk=2048))
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        cold_req, hit_req = Request("cold", doc + q1, params), Request("hit", doc + q2, params)
        cold = time_to_first_token(engine, cold_req)
        hit = time_to_first_token(engine, hit_req)
        reference = LLMEngine(model, EngineConfig(max_model_len=doc_len + 64, max_num_seqs=1,
                                                  enable_prefix_caching=False))
        same = reference.generate([Request("ref", doc + q2, params)])["ref"] == hit_req.output_token_ids
        rows.append([mode, hit_req.num_cached_tokens, hit_req.num_recomputed_tokens, cold, hit, cold / hit,
                     "yes" if same else "NO"])
        out.append({"mode": mode, "prompt_tokens": len(doc) + 24, "skipped_tokens": hit_req.num_cached_tokens,
                    "recomputed_tokens": hit_req.num_recomputed_tokens, "ttft_cold_s": cold, "ttft_hit_s": hit,
                    "speedup": cold / hit, "greedy_equal_to_cold": same})
    return rows, out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--contexts", default="8192,32768,131072")
    parser.add_argument("--doc", type=int, default=8192)
    args = parser.parse_args()
    torch.set_num_threads(2)
    model = build_tiny()

    rows, memory = memory_rows(model, [int(x) for x in args.contexts.split(",")])
    print_table("memory per request (bytes; ratio = uniform paged / v4serve)",
                ["context", "state", "blocks", "blocks theory", "uniform paged", "ratio"], rows)
    rows, reuse = reuse_rows(model, args.doc)
    print_table(f"repeated {args.doc}-token document, new question (seconds to first token)",
                ["mode", "skipped", "recomputed", "cold", "hit", "cold/hit", "same tokens"], rows)
    write_results("bench_cache", {"memory": memory, "prefix_reuse": reuse})


if __name__ == "__main__":
    main()
