"""Where a decode step's time goes: the engine decoding a batch (the bench_decode_graphs model: 4 layers
at real head widths, bf16 on CUDA) under torch's profiler. It prints the wall time per step beside the
device's busy time per step (the sum of kernel times: well under the wall time, the step is host-bound),
then the top operators by host time and by device time, then the Python functions with the most own
time over as many steps again under cProfile (where a host-bound step's time goes), and writes them to
bench/results/profile_decode.json.

    python bench/profile_decode.py [--device cuda] [--batch 1] [--steps 16] [--enforce-eager]
        [--async-scheduling auto|on|off] [--smoke]

On a CPU (`--smoke`: small widths) there is no device column: the forward runs on the host.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_gpu import REAL, SMOKE  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.kernels.registry import load_kernels  # noqa: E402

TOP = 20


def top_ops(prof: profile, key: str, steps: int, shapes: bool = False) -> list[dict]:
    """The operators with the most self time (`key`: cpu or device), per step, in microseconds; with
    `shapes`, ATen operators only, told apart by their inputs' shapes (which copy is which: an eager
    step's kernels are timed against the operator that launched them, a replayed graph's against none)."""
    events = [e for e in prof.key_averages(group_by_input_shape=shapes) if getattr(e, f"self_{key}_time_total", 0) > 0
              and (not shapes or e.key.startswith("aten::"))]
    events.sort(key=lambda e: getattr(e, f"self_{key}_time_total"), reverse=True)
    return [{"name": e.key + (f" {e.input_shapes}" if shapes else ""), "calls_per_step": e.count / steps,
             "self_us_per_step": getattr(e, f"self_{key}_time_total") / steps} for e in events[:TOP]]


def top_python(stats: pstats.Stats, steps: int) -> list[dict]:
    """The Python functions with the most own time, per step, in microseconds."""
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:TOP]  # type: ignore[attr-defined]
    return [{"name": f"{Path(file).name}:{line} {func}", "calls_per_step": calls / steps,
             "self_us_per_step": own * 1e6 / steps, "cumulative_us_per_step": cum * 1e6 / steps}
            for (file, line, func), (_, calls, own, cum, _) in rows]


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=16, help="decode steps profiled (after as many warm ones)")
    parser.add_argument("--prompt", type=int, default=256)
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--async-scheduling", default="auto", choices=["auto", "on", "off"])
    parser.add_argument("--smoke", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    cfg = tiny_config(**(SMOKE if args.smoke else REAL))
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = build_tiny(cfg, seed=0).to(device, dtype)
    model.use_kernels(load_kernels("triton" if device.type == "cuda" else "torch", device))
    engine = LLMEngine(model, EngineConfig(max_num_seqs=args.batch, max_model_len=args.prompt + 3 * args.steps + 64,
                                           kv_dtype=dtype, enable_prefix_caching=False,
                                           enforce_eager=args.enforce_eager,
                                           async_scheduling=args.async_scheduling))
    gen = torch.Generator().manual_seed(0)
    for i in range(args.batch):
        prompt = torch.randint(0, cfg.vocab_size, (args.prompt,), generator=gen).tolist()
        engine.add_request(Request(f"r{i}", prompt, SamplingParams(max_tokens=3 * args.steps + 4, ignore_eos=True)))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running + list(
            engine.scheduler.waiting)):
        engine.step()
    for _ in range(args.steps):  # warm: lazy set-up, the allocator, Triton's launchers
        engine.step()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    walls = []
    with profile(activities=activities, record_shapes=True) as prof:
        for _ in range(args.steps):
            start = time.perf_counter()
            engine.step()
            walls.append(time.perf_counter() - start)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    python = cProfile.Profile()
    python.enable()
    for _ in range(args.steps):
        engine.step()
    python.disable()
    engine.close()
    by_python = top_python(pstats.Stats(python), args.steps)
    wall_us = statistics.median(walls) * 1e6
    by_cpu = top_ops(prof, "cpu", args.steps)
    by_device = top_ops(prof, "device", args.steps) if device.type == "cuda" else []
    by_shape = top_ops(prof, "device" if device.type == "cuda" else "cpu", args.steps, shapes=True)
    device_us = (sum(e.self_device_time_total for e in prof.key_averages()) / args.steps
                 if device.type == "cuda" else None)
    print(f"\n{args.device}, batch {args.batch}, {cfg.num_layers} layers, graphs {engine.cuda_graphs}, async "
          f"{engine.async_scheduling}: {wall_us:.0f} us per step (median)"
          + (f", device busy {device_us:.0f} us per step ({device_us / wall_us:.0%} of it)" if device_us else ""))
    print_table("top operators by host (self CPU) time, per step", ["operator", "calls", "us"],
                [[e["name"][:70], f"{e['calls_per_step']:.1f}", f"{e['self_us_per_step']:.1f}"] for e in by_cpu])
    if by_device:
        print_table("top operators and kernels by device time, per step", ["kernel", "calls", "us"],
                    [[e["name"][:70], f"{e['calls_per_step']:.1f}", f"{e['self_us_per_step']:.1f}"]
                     for e in by_device])
    print_table("top ATen operators by their own " + ("device" if device.type == "cuda" else "host")
                + " time, by input shapes, per step", ["operator and shapes", "calls", "us"],
                [[e["name"][:110], f"{e['calls_per_step']:.1f}", f"{e['self_us_per_step']:.1f}"] for e in by_shape])
    print_table("top Python functions by own time, per step (cProfile)", ["function", "calls", "own us", "cum us"],
                [[e["name"][:70], f"{e['calls_per_step']:.1f}", f"{e['self_us_per_step']:.1f}",
                  f"{e['cumulative_us_per_step']:.1f}"] for e in by_python])
    results = {"device": args.device, "batch": args.batch, "cuda_graphs": engine.cuda_graphs,
               "async_scheduling": engine.async_scheduling, "wall_us_per_step": wall_us,
               "device_busy_us_per_step": device_us, "top_host_ops": by_cpu, "top_device_ops": by_device,
               "top_aten_ops_by_shape": by_shape,
               "top_python_functions": by_python}
    write_results("profile_decode", results)
    return results


if __name__ == "__main__":
    main()
