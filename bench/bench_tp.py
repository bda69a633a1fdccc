"""Tensor parallelism on CPU ranks (gloo): the step time of 2 ranks against one process on the same
checkpoint, and the bytes each rank puts into collectives per decode step.

    python bench/bench_tp.py [--ranks 2] [--prompt 512] [--decode 32] [--set KEY=VALUE ...]

Each rank gets cores/ranks threads; the single process runs with one thread and with all cores
(on a busy machine, more threads than free cores can be much slower than one: both are shown, and
ratios are to the faster). On this 2-core machine TP is expected to be slower: the same FLOPs on
the same cores plus the collectives. It is the path to models that do not fit one device, not a CPU
speedup.
`--set` sizes the model as `v4serve make-checkpoint --set` does (default: the 30M-parameter config).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.engine.model.checkpoint import load_model, write_checkpoint  # noqa: E402
from v4serve.engine.model.ranks import SequenceCase, run_on_ranks, run_sequence  # noqa: E402
from v4serve.engine.model.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.server.cli import _parse_override  # noqa: E402

MODEL_30M = dict(hidden_size=256, num_heads=8, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), num_layers=8,
                 n_routed_experts=16, moe_intermediate_size=256, q_lora_rank=128, o_lora_rank=128)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=512)
    parser.add_argument("--decode", type=int, default=32)
    parser.add_argument("--set", type=_parse_override, action="append", metavar="KEY=VALUE", default=[])
    args = parser.parse_args()
    overrides = dict(args.set) or dict(MODEL_30M)
    if "compress_ratios" in overrides:
        overrides["compress_ratios"] = tuple(overrides["compress_ratios"])
        overrides.setdefault("num_layers", len(overrides["compress_ratios"]))
    cfg = tiny_config(**overrides)
    folder = write_checkpoint(build_tiny(cfg), Path(tempfile.mkdtemp(prefix="bench-tp-")))
    prompt = tuple(10 + (7 * i) % (cfg.vocab_size - 10) for i in range(args.prompt))
    case = SequenceCase(str(folder), prompt=prompt, chunk=256, decode_steps=args.decode)
    model = load_model(folder, progress=False)
    singles = {}
    for threads in sorted({1, os.cpu_count() or 1}):
        torch.set_num_threads(threads)
        singles[f"1 process, {threads} thread(s)"] = run_sequence(model, case)
    one = min(singles.values(), key=lambda result: result.decode_seconds)
    tp, ep = run_on_ranks([case, dataclasses.replace(case, expert_parallel=True)], args.ranks)
    rows, payload = [], {}
    for name, result in (*singles.items(), (f"TP {args.ranks}", tp), (f"TP {args.ranks} + EP", ep)):
        moved = result.decode_traffic
        rows.append([name, result.prefill_seconds, 1e3 * result.decode_seconds,
                     result.decode_seconds / one.decode_seconds, moved.get("all_reduce", 0),
                     moved.get("all_gather", 0), moved.get("calls", 0), max(result.resident_bytes) / 1e6])
        payload[name] = {"prefill_seconds": result.prefill_seconds, "decode_step_seconds": result.decode_seconds,
                         "decode_traffic_bytes": moved, "resident_bytes": result.resident_bytes,
                         "same_tokens": result.tokens == one.tokens}
    print_table(f"{sum(p.numel() for p in build_tiny(cfg).parameters()) / 1e6:.1f}M parameters, prompt "
                f"{args.prompt} (chunks of 256), {args.decode} decodes, {os.cpu_count()} cores",
                ["", "prefill s", "decode ms/step", "x best 1 process", "all-reduce B/step", "all-gather B/step",
                 "collectives/step", "MB per rank"], rows)
    write_results("bench_tp", payload)


if __name__ == "__main__":
    main()
