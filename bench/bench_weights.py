"""Weights resident in checkpoint precision vs dequantized at load: load time, peak host memory and
CPU decode tokens/s of the tiny and 30M-parameter configs from `--quantize mixed` checkpoints (FP4
experts, FP8 elsewhere, as the released V4 checkpoints).

    .venv/bin/python bench/bench_weights.py [--decode 32] [--repeats 3] [--quantize mixed]

Each load runs in a fresh process so its peak RSS is its own (reported above the RSS of a process
that has only imported v4serve). Decode runs both models in one process, in turns, and reports the
ratio. Results: bench/results/bench_weights.json.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import interleaved, print_table, write_results  # noqa: E402
from v4serve.engine.model.config import ModelConfig  # noqa: E402
from v4serve.engine.model.parallel.single import SingleSequence  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint  # noqa: E402
from v4serve.engine.model.weights.files import read_config_json  # noqa: E402
from v4serve.engine.model.weights.packed import resident_bytes  # noqa: E402
from v4serve.kernels.registry import load_kernels  # noqa: E402

CONFIGS = {
    "tiny": {},
    "30M": dict(hidden_size=256, num_heads=8, compress_ratios=(0, 0, 4, 128, 4, 128, 4, 128), num_layers=8,
                n_routed_experts=16, moe_intermediate_size=256, q_lora_rank=128, o_lora_rank=128),
}
MODES = {"packed": True, "dequantized": False}
PROMPT = list(range(3, 3 + 200))


def peak_rss_bytes() -> int:
    """The process's RSS high-water mark since the last `reset_peak_rss` (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def reset_peak_rss() -> None:
    """Restart the high-water mark at the current RSS (Linux: writing 5 to clear_refs), so the
    import-time peak does not hide the load's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def child(folder: str, mode: str) -> None:
    """Runs in its own process: load once, print the figures as JSON."""
    # Building the model imports the kernel modules (Triton among them): done once on the meta
    # device first, so the baseline holds the code and the growth is the load's own.
    with torch.device("meta"):
        DeepseekV4(ModelConfig.from_dict(read_config_json(folder)))
    baseline = current_rss_bytes()
    reset_peak_rss()
    t0 = time.perf_counter()
    model = load_model(folder, packed=MODES[mode], progress=False)
    elapsed = time.perf_counter() - t0
    print(json.dumps({"load_s": elapsed, "peak_rss_bytes": peak_rss_bytes(), "baseline_rss_bytes": baseline,
                      "resident_bytes": resident_bytes(model)}))


def measure_load(folder: Path, mode: str) -> dict:
    out = subprocess.run([sys.executable, __file__, "--child", str(folder), mode], check=True, capture_output=True,
                         text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def decode_seconds(model: torch.nn.Module, prompt: list[int], steps: int) -> float:
    seq = SingleSequence(model, len(prompt) + steps + 1)
    seq.prefill(prompt)
    t0 = time.perf_counter()
    token = prompt[-1]
    for _ in range(steps):
        token = int(seq.step([token]).argmax())
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--child", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    parser.add_argument("--decode", type=int, default=32, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantize", default="mixed", choices=("fp8", "fp4", "mixed"))
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    rows, results = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in CONFIGS.items():
            folder = write_checkpoint(build_tiny(tiny_config(**overrides)), Path(tmp) / name, quantize=args.quantize)
            loads = {mode: measure_load(folder, mode) for mode in MODES}
            models = {mode: load_model(folder, packed=packed, progress=False) for mode, packed in MODES.items()}
            for model in models.values():
                model.use_kernels(load_kernels("torch"))
            times = interleaved({mode: (lambda m=m: decode_seconds(m, PROMPT, args.decode))
                                 for mode, m in models.items()}, args.repeats)
            for mode in MODES:
                load = loads[mode]
                growth = load["peak_rss_bytes"] - load["baseline_rss_bytes"]
                tok_s = args.decode / times[mode]
                entry = {"config": name, "mode": mode, **load, "peak_rss_growth_bytes": growth,
                         "decode_tok_s": tok_s, "decode_ratio_vs_dequantized": times["dequantized"] / times[mode],
                         "rss_ratio_vs_dequantized": growth / max(1, loads["dequantized"]["peak_rss_bytes"]
                                                                      - loads["dequantized"]["baseline_rss_bytes"])}
                results.append(entry)
                rows.append([name, mode, load["resident_bytes"] / 1e6, growth / 1e6, entry["rss_ratio_vs_dequantized"],
                             load["load_s"], tok_s, entry["decode_ratio_vs_dequantized"]])
    print_table(f"{args.quantize} checkpoints: packed (checkpoint precision) vs dequantized at load, CPU fp32",
                ["config", "weights", "resident MB", "peak RSS +MB", "RSS ratio", "load s", "decode tok/s",
                 "decode ratio"], rows)
    write_results("bench_weights", {"quantize": args.quantize, "decode_steps": args.decode, "results": results})


if __name__ == "__main__":
    main()
