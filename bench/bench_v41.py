"""DeepSeek-V4.1 beside V4 on the embedded models (`tiny-v41`, `tiny`), as `serve` runs them on this CPU (torch
kernels, fp32, serve's engine settings), side by side in one process: KV bytes per token of a long prompt (the
request's slot and blocks, as allocated), cold prefill time, and time to first token on a device hit and on a
disk hit after a restart (the SSD store in a temporary folder), as ratios; and V4.1's prefill with and without
its layers past the last KV source run on the chunk's tail alone (`DeepseekV41.late_layers_on_tail`).

    python bench/bench_v41.py [--tokens 4096] [--repeat 3]

"first hit": the first request on a cached document, which recomputes its window (the zero-mode span, (W − 1) x
layers tokens, until a snapshot lies at the boundary); "device hit": the next one, from the snapshot the first left;
"disk hit": a restarted engine, from the store's files.
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_to_first_token, write_results  # noqa: E402
from v4serve.engine.engine import LLMEngine  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.server.config import ServeConfig  # noqa: E402
from v4serve.server.model_loading import engine_config, load  # noqa: E402

QUESTION = 32  # tokens after the shared document: a hit computes these (and its last block)


def tokens(n: int, seed: int) -> list[int]:
    import torch

    return torch.randint(64, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def engine(model_name: str, size: int, store: Path, tail: bool = True) -> LLMEngine:
    config = ServeConfig(model=model_name, device="cpu", attention_backend="torch", kv_store_dir=str(store),
                         max_model_len=size + 64, max_num_seqs=1)
    model = load(config)
    if hasattr(model, "late_layers_on_tail"):
        model.late_layers_on_tail = tail
    return LLMEngine(model, engine_config(config, model, None))


def ask(eng: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, Request]:
    request = Request(rid, prompt, SamplingParams(max_tokens=1, ignore_eos=True))
    seconds = time_to_first_token(eng, request)
    while eng.has_work():
        eng.step()
    return seconds, request


def one_model(model_name: str, size: int, repeat: int, folder: Path) -> dict[str, Any]:
    store = folder / model_name
    eng = engine(model_name, size, store)
    ask(eng, "warm-up", tokens(256, 0))
    document = tokens(size - QUESTION, size)
    cold, _ = ask(eng, "cold", document + tokens(QUESTION, 1))
    blocks = -(-size // eng.cache_config.block_size)
    kv_bytes = eng.device_kv.slot_nbytes() + blocks * eng.device_kv.block_nbytes()  # what a request this long holds
    colds = [cold] + [ask(eng, f"cold{k}", tokens(size, 100 * k + size))[0] for k in range(1, repeat)]
    # The first hit recomputes the window from its last snapshot (none this early: the zero-mode span); the
    # next one finds the snapshot the first left at the boundary, as a restarted daemon does on disk.
    first_hit, hit = ask(eng, "hit", document + tokens(QUESTION, 2))
    device_hit, _ = ask(eng, "hit2", document + tokens(QUESTION, 4))
    assert hit.num_hit_tokens > 0
    eng.close()
    restarted = engine(model_name, size, store)
    ask(restarted, "warm-up", tokens(256, 0))
    disk_hit, again = ask(restarted, "disk", document + tokens(QUESTION, 3))
    assert again.num_disk_hit_tokens > 0
    restarted.close()
    return {"model": model_name, "tokens": size, "kv_bytes": kv_bytes, "kv_bytes_per_token": kv_bytes / size,
            "block_bytes_per_token": eng.device_kv.block_nbytes() / eng.cache_config.block_size,
            "cold_s": statistics.median(colds), "cold_runs_s": colds, "first_hit_s": first_hit,
            "device_hit_s": device_hit, "disk_hit_s": disk_hit, "hit_tokens": hit.num_hit_tokens}


def split(size: int, repeat: int, folder: Path) -> dict[str, Any]:
    """V4.1's cold prefill with its late layers on the tail and on every row, alternating in one process."""
    runs: dict[bool, list[float]] = {True: [], False: []}
    engines = {tail: engine("tiny-v41", size, folder / f"split-{tail}", tail) for tail in runs}
    for eng in engines.values():
        ask(eng, "warm-up", tokens(256, 0))
    for k in range(repeat):
        for tail, eng in engines.items():
            runs[tail].append(ask(eng, f"{tail}-{k}", tokens(size, 7000 + k))[0])
    for eng in engines.values():
        eng.close()
    ratios = [off / on for on, off in zip(runs[True], runs[False], strict=True)]
    return {"tail_s": runs[True], "every_row_s": runs[False], "speedups": ratios, "median_speedup":
            statistics.median(ratios)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=4096, help="prompt length")
    parser.add_argument("--repeat", type=int, default=3, help="cold prompts per model (the median is reported)")
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="bench-v41-"))
    try:
        models = [one_model(name, args.tokens, args.repeat, folder) for name in ("tiny", "tiny-v41")]
        tail = split(args.tokens, args.repeat, folder)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    v4, v41 = models
    print_table(f"embedded models, {args.tokens}-token prompts, one at a time, torch kernels, fp32 CPU (seconds; "
                "KV bytes as allocated for the request: its slot and blocks)",
                ["model", "KV B/token", "block B/token", "cold TTFT", "first hit", "device hit", "disk hit",
                 "cold/first", "cold/device", "cold/disk"],
                [[m["model"], m["kv_bytes_per_token"], m["block_bytes_per_token"], m["cold_s"], m["first_hit_s"],
                  m["device_hit_s"], m["disk_hit_s"], m["cold_s"] / m["first_hit_s"], m["cold_s"] / m["device_hit_s"],
                  m["cold_s"] / m["disk_hit_s"]] for m in models])
    print(f"\nV4.1 / V4 KV bytes per token: {v41['kv_bytes_per_token'] / v4['kv_bytes_per_token']:.2f}x "
          "(the tiny models' shapes differ: see README for Flash's)")
    print(f"V4.1 cold prefill, late layers on every row / on the tail: median {tail['median_speedup']:.2f}x "
          f"({', '.join(f'{r:.2f}' for r in tail['speedups'])}; side by side, alternating)")
    write_results("bench_v41", {"models": models, "late_layers_on_tail": tail})


if __name__ == "__main__":
    main()
