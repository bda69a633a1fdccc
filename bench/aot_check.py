"""Compile every Triton specialization v4serve launches at DeepSeek-V4-Flash and -Pro's real shapes
for sm_80 (A100), sm_90 (H100/H200) and sm_100 (B200), without a GPU: the model runs on the meta
device under a launch recorder (engine/model/gpu/aot.py), and Triton's compiler and ptxas build each
launch for each target (kernels/aot.py). Scenarios: both models, bf16 and FP8 KV, TP 1, TP 8 and
TP 8 with expert parallelism, packed FP8/FP4 weights; decode at batch 1 to 256 and contexts
300 to 64K (and a captured step's tables padded to 64K), prefill chunks and a mixed step.

Prints, per kernel and target, the worst registers, spills and shared memory over its
specializations, then every problem (a compile error, shared memory over the target's limit,
registers x threads over an SM's register file, a spill in a kernel a decode step runs, any other
spill without a reason in ALLOWED_SPILLS), and
writes bench/results/aot.json. Exits 1 when there is a problem.

    python bench/aot_check.py [--jobs N] [--representatives] [--markdown]

(`--markdown` also prints the table as README shows it.)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.engine.model.gpu.aot import DECODE_STEPS, PREFILL_STEPS, SCENARIOS, record_scenarios  # noqa: E402
from v4serve.kernels.aot import TARGETS, compile_launches, problems, representatives, table  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compile processes")
    parser.add_argument("--representatives", action="store_true",
                        help="one specialization of each kind (as the suite compiles) instead of all")
    parser.add_argument("--markdown", action="store_true", help="also print the table as README shows it")
    args = parser.parse_args()
    start = time.perf_counter()
    recorded = record_scenarios(SCENARIOS)
    launches = list(recorded.scenarios)
    if args.representatives:
        launches = representatives(launches)
    print(f"{len(recorded.scenarios)} specializations recorded over {len(SCENARIOS)} scenarios and "
          f"{len(DECODE_STEPS) + len(PREFILL_STEPS)} step shapes in {time.perf_counter() - start:.1f} s; "
          f"compiling {len(launches)} for {', '.join(t.name for t in TARGETS)} with {args.jobs} processes")
    start = time.perf_counter()
    results = compile_launches(launches, jobs=args.jobs)
    elapsed = time.perf_counter() - start
    rows = table(results)
    decode = recorded.decode_kernels
    print_table("worst specialization per kernel and target (registers; spill bytes per thread; shared memory)",
                ["kernel", "target", "decode", "specs", "errors", "regs", "spill st/ld", "shared B", "limit B"],
                [[r["kernel"], r["target"], "yes" if r["kernel"] in decode else "", r["specializations"], r["errors"],
                  r["registers"], f"{r['spill_stores']}/{r['spill_loads']}", r["shared"], r["shared_limit"]]
                 for r in rows])
    if args.markdown:
        print("\n" + markdown(rows, decode))
    found = problems(results, recorded.decode_kernels)
    print(f"\n{len(results)} compiles in {elapsed:.0f} s; {len(found)} problems")
    for problem in found:
        print(f"  - {problem}")
    write_results("aot", {"targets": [asdict(t) for t in TARGETS], "decode_kernels": sorted(recorded.decode_kernels),
                          "table": rows, "problems": found,
                          "compiled": [{**asdict(r), "scenarios": sorted(recorded.scenarios[launch])}
                                       for launch, r in zip((x for x in launches for _ in TARGETS), results,
                                                            strict=True)]})
    return 1 if found else 0


def markdown(rows: list[dict], decode: set[str]) -> str:
    """One line per kernel, a column per target: registers, spill bytes (stored/loaded), shared memory."""
    targets = [t.name for t in TARGETS]
    by_kernel: dict[str, dict[str, dict]] = {}
    for r in rows:
        by_kernel.setdefault(r["kernel"], {})[r["target"]] = r
    lines = ["| kernel | decode | specializations | " + " | ".join(targets) + " |",
             "|---|---|---|" + "---|" * len(targets)]
    for kernel, cells in by_kernel.items():
        text = [f"{c['registers']} regs, {c['spill_stores']}/{c['spill_loads']} B spilled, {c['shared'] / 1024:.0f} KiB"
                for c in (cells[t] for t in targets)]
        lines.append(f"| `{kernel}` | {'yes' if kernel in decode else ''} | {cells[targets[0]]['specializations']} | "
                     + " | ".join(text) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
