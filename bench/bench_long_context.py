"""Long prompts on the embedded tiny model as `serve` runs it (torch kernels, fp32, this CPU, serve's
engine settings, a prefix store in a temporary folder), one prompt at a time. Per prompt length:
time to first token cold and on a prefix hit (the same document, a new question), decode ms per
token after the cold prompt, resident memory, and the store's bytes, beside the capacity plan's
figures for one sequence of that length. Each length runs in a process of its own, so resident
memory is that length's alone. Prefill runs on every core, as serve's engine does (`--threads 1`
gives steadier figures on a machine others are using: two threads wait on each other there).
Goal (issue #47): a 32K-token cold prefill at most 2.5x a 16K one.

    python bench/bench_long_context.py [--sizes 4096,16384,32768] [--decode 16] [--repeat 3] [--threads N] [--dir DIR]
    python bench/bench_long_context.py --sizes 4096,16384,32768,65536,131072 --repeat 1   # minutes at 128K
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.engine.engine import LLMEngine  # noqa: E402
from v4serve.engine.model.parallel.sharding import default_threads  # noqa: E402
from v4serve.engine.model.plan import PlanSettings, plan_checkpoint  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.engine.model.weights.checkpoint import write_checkpoint  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.server.config import ServeConfig  # noqa: E402
from v4serve.server.model_loading import engine_config  # noqa: E402

QUESTION = 32  # tokens after the shared document: the hit recomputes only these (and the tail block)
GOAL_32K_OVER_16K = 2.5


def tokens(n: int, seed: int) -> list[int]:
    return torch.randint(64, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def memory_kib(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS: resident now, VmHWM: the peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def first_token(engine: LLMEngine, request: Request) -> float:
    """Seconds from adding a request until its first token."""
    t0 = time.perf_counter()
    engine.add_request(request)
    while not request.output_token_ids:
        engine.step()
    return time.perf_counter() - t0


def decode_ms(engine: LLMEngine) -> float:
    """Median milliseconds of the engine's remaining steps (one decoding request: one token each)."""
    steps = []
    while engine.has_work():
        t0 = time.perf_counter()
        engine.step()
        steps.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(steps) if steps else float("nan")


def planned(size: int, max_model_len: int, folder: Path) -> dict[str, Any]:
    """The capacity plan's figures for the tiny model at this length (one sequence, a CPU, fp32)."""
    checkpoint = folder / "checkpoint"
    write_checkpoint(build_tiny(), checkpoint)
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    plan = plan_checkpoint(checkpoint, PlanSettings(memory_bytes=memory, device="cpu", max_model_len=max_model_len,
                                                    max_num_seqs=1))
    shutil.rmtree(checkpoint)
    blocks = -(-size // plan.block_size)
    return {"weights_bytes": plan.weights_per_rank.total, "activation_reserve_bytes": plan.activation_reserve_bytes,
            "kv_bytes_per_sequence": plan.kv_bytes_per_sequence,
            "kv_bytes_at_size": plan.state_cache_bytes_per_request + blocks * plan.block_cache_bytes_per_block,
            "block_cache_bytes_per_token": plan.block_cache_bytes_per_block / plan.block_size}


def one_size(size: int, decode: int, folder: Path, threads: int, repeat: int = 1) -> dict[str, Any]:
    """Cold prompt (then `decode` tokens), a hit on its document, the store's bytes, then `repeat` - 1
    more cold prompts (new documents): the cold TTFT reported is the median of all."""
    max_model_len = size + decode + 64
    plan = planned(size, max_model_len, folder)
    torch.set_num_threads(threads)  # the engine's prefill threads are those set when it is built
    model = build_tiny()
    before_kib = memory_kib("VmRSS")
    config = ServeConfig(device="cpu", attention_backend="torch", kv_store_dir=str(folder / "store"),
                         max_model_len=max_model_len, max_num_seqs=1)
    engine = LLMEngine(model, engine_config(config, model, None))
    first_token(engine, Request("warm-up", tokens(512, 0), SamplingParams(max_tokens=2, ignore_eos=True)))
    decode_ms(engine)  # a serving process has run its first steps (lazy set-up) before a long prompt comes
    document = tokens(size - QUESTION, size)
    cold = Request("cold", document + tokens(QUESTION, 1), SamplingParams(max_tokens=1 + decode, ignore_eos=True))
    cold_s = first_token(engine, cold)
    kv_bytes = engine.device_kv.slot_nbytes() + len(cold.kv.block_table) * engine.device_kv.block_nbytes()
    step_ms = decode_ms(engine)
    hit = Request("hit", document + tokens(QUESTION, 2), SamplingParams(max_tokens=1, ignore_eos=True))
    hit_s = first_token(engine, hit)
    decode_ms(engine)
    rss_kib, peak_kib = memory_kib("VmRSS"), memory_kib("VmHWM")
    store = 0
    if engine.kv.store is not None:
        engine.kv.store.flush()
        store = engine.kv.store.stats.bytes_written
    colds = [cold_s]
    for k in range(1, repeat):
        colds.append(first_token(engine, Request(f"cold{k}", tokens(size, 10**6 * k + size),
                                                 SamplingParams(max_tokens=1, ignore_eos=True))))
        decode_ms(engine)
    engine.close()
    return {"tokens": size, "ttft_cold_s": statistics.median(colds), "ttft_cold_runs_s": colds,
            "ttft_hit_s": hit_s, "hit_tokens": hit.num_cached_tokens,
            "decode_ms_per_token": step_ms, "decode_tokens": decode, "rss_bytes": rss_kib << 10,
            "peak_rss_bytes": peak_kib << 10, "rss_growth_bytes": (rss_kib - before_kib) << 10,
            "kv_bytes": kv_bytes, "store_bytes": store, "threads": threads, "plan": plan}


def paired_ratio(folder: Path, threads: int, pairs: int) -> dict[str, Any]:
    """The goal's figure measured side by side: 16K and 32K cold prompts (new documents) alternating in
    one engine, `pairs` times; the median of each pair's 32K / 16K. A machine shared with others
    drifts by tens of percent between processes, so lengths timed in processes of their own are not
    comparable to that precision."""
    torch.set_num_threads(threads)
    model = build_tiny()
    config = ServeConfig(device="cpu", attention_backend="torch", kv_store_dir=str(folder / "store"),
                         max_model_len=32768 + 64, max_num_seqs=1)
    engine = LLMEngine(model, engine_config(config, model, None))
    first_token(engine, Request("warm-up", tokens(512, 0), SamplingParams(max_tokens=2, ignore_eos=True)))
    decode_ms(engine)
    runs: dict[int, list[float]] = {16384: [], 32768: []}
    for k in range(pairs):
        for size in runs:
            request = Request(f"{size}-{k}", tokens(size, 7 * 10**6 + 10 * k + size // 16384),
                              SamplingParams(max_tokens=1, ignore_eos=True))
            runs[size].append(first_token(engine, request))
            decode_ms(engine)
    engine.close()
    ratios = [b / a for a, b in zip(runs[16384], runs[32768], strict=True)]
    return {"cold_16k_s": runs[16384], "cold_32k_s": runs[32768], "ratios": ratios,
            "median_ratio": statistics.median(ratios)}


def run_in_child(size: int, decode: int, folder: Path, threads: int, repeat: int) -> dict[str, Any]:
    """`one_size` in a fresh process: its resident memory is this length's alone."""
    out = subprocess.run([sys.executable, __file__, "--one", str(size), "--decode", str(decode), "--dir", str(folder),
                          "--threads", str(threads), "--repeat", str(repeat)], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def mib(n: float) -> float:
    return n / (1 << 20)


def report(results: list[dict[str, Any]]) -> dict[str, Any]:
    rows = [[r["tokens"], r["ttft_cold_s"], r["ttft_hit_s"], r["ttft_cold_s"] / r["ttft_hit_s"],
             r["decode_ms_per_token"], mib(r["peak_rss_bytes"]), mib(r["rss_growth_bytes"]),
             mib(r["plan"]["activation_reserve_bytes"] + r["plan"]["kv_bytes_per_sequence"]), mib(r["kv_bytes"]),
             mib(r["plan"]["kv_bytes_at_size"]), mib(r["store_bytes"])] for r in results]
    print_table(f"embedded tiny model, one prompt at a time, torch kernels, fp32 CPU, {results[0]['threads']} prefill "
                "thread(s) (seconds, ms, MiB). Engine RSS: "
                "resident memory the engine added; plan: the capacity plan's reserve + one sequence's KV, and its KV "
                "at this length beside the request's",
                ["tokens", "cold TTFT", "hit TTFT", "cold/hit", "decode ms/tok", "peak RSS", "engine RSS", "plan",
                 "KV", "plan KV", "store"], rows)
    return {}


def report_ratio(paired: dict[str, Any]) -> dict[str, Any]:
    ratio = paired["median_ratio"]
    verdict = "meets" if ratio <= GOAL_32K_OVER_16K else "misses"
    print(f"\n32K / 16K cold prefill, side by side in one engine ({len(paired['ratios'])} pairs: "
          f"{', '.join(f'{r:.2f}' for r in paired['ratios'])}): median {ratio:.2f}x ({verdict} the goal of "
          f"<= {GOAL_32K_OVER_16K}x); 16K {statistics.median(paired['cold_16k_s']):.2f} s, "
          f"32K {statistics.median(paired['cold_32k_s']):.2f} s")
    return {"paired": paired, "cold_32k_over_16k": ratio, "goal": GOAL_32K_OVER_16K,
            "meets_goal": ratio <= GOAL_32K_OVER_16K}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4096,16384,32768", help="prompt lengths in tokens (up to 131072)")
    parser.add_argument("--decode", type=int, default=16, help="tokens decoded after each cold prompt")
    parser.add_argument("--threads", type=int, default=default_threads(1), help="prefill threads (default: every core)")
    parser.add_argument("--dir", default=None, help="where to put the stores (default: a temporary folder)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="cold prompts per length (new documents); the median is reported (this machine is noisy)")
    parser.add_argument("--pairs", type=int, default=3, help="16K/32K pairs timed side by side (0: none)")
    parser.add_argument("--paired", action="store_true", help=argparse.SUPPRESS)  # the child that times them
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # a child's single length
    args = parser.parse_args()
    if args.paired:
        print(json.dumps(paired_ratio(Path(args.dir), args.threads, args.pairs)))
        return
    if args.one is not None:
        print(json.dumps(one_size(args.one, args.decode, Path(args.dir), args.threads, args.repeat)))
        return
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-long-"))
    results: list[dict[str, Any]] = []
    try:
        for size in [int(x) for x in args.sizes.split(",")]:
            results.append(run_in_child(size, args.decode, base / str(size), args.threads, args.repeat))
            r = results[-1]
            print(f"  {size:>6} tokens: cold {r['ttft_cold_s']:.2f}s (median of {len(r['ttft_cold_runs_s'])}), "
                  f"hit {r['ttft_hit_s']:.3f}s, "
                  f"decode {r['decode_ms_per_token']:.1f} ms/token", flush=True)
        paired = None
        if args.pairs:
            out = subprocess.run([sys.executable, __file__, "--paired", "--pairs", str(args.pairs), "--dir",
                                  str(base / "paired"), "--threads", str(args.threads)], check=True,
                                 capture_output=True, text=True)
            paired = json.loads(out.stdout.strip().splitlines()[-1])
    finally:
        if args.dir is None:
            shutil.rmtree(base, ignore_errors=True)
    summary = report(results) if results else {}
    if paired is not None:
        summary.update(report_ratio(paired))
    write_results("bench_long_context", {"sizes": results, **summary})


if __name__ == "__main__":
    main()
