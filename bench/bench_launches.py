"""Device work items of one decode step, per layer, for each kernel backend.

A work item is a non-view ATen op (each is at least one kernel launch on a GPU) or a Triton launch
(counted at the launcher; the dispatcher never sees those). On a GPU, a decode step that issues a
few hundred items per layer is launch-bound whatever the batch. Counted on the CPU: the counts do
not depend on the device (Triton runs interpreted here, launch for launch).

    .venv/bin/python bench/bench_launches.py [--batch 1,16] [--context 300]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.cache.device_kv import DeviceKV  # noqa: E402
from v4serve.cache.layout import KVLayout  # noqa: E402
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk  # noqa: E402
from v4serve.engine.model.v4.model import DeepseekV4  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.kernels.launches import LaunchCounter  # noqa: E402
from v4serve.kernels.registry import Kernels, load_kernels, triton_available  # noqa: E402


def decode_step_counts(model: DeepseekV4, kernels: Kernels, batch: int, context: int) -> dict[str, float]:
    """Prefill `batch` sequences of `context` tokens (torch kernels: interpreted Triton is slow and
    the prefill is not what is counted), then count one decode step of all of them on `kernels`."""
    cfg = model.cfg
    model.use_kernels(load_kernels("torch"))
    per_seq = -(-(context + 1) // cfg.block_size)
    kv = DeviceKV(KVLayout.from_config(cfg), num_slots=batch, num_blocks=batch * per_seq + 1)
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(batch)]
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        meta = AttentionMetadata.build([SeqChunk(slot=i, block_table=tables[i], start=0, num_new=context)])
        model(torch.randint(0, cfg.vocab_size, (context,), generator=gen), meta, kv)
    meta = AttentionMetadata.build([SeqChunk(slot=i, block_table=tables[i], start=context, num_new=1)
                                    for i in range(batch)])
    model.use_kernels(kernels)
    per_layer: list[int] = []
    allocs: list[int] = []
    hooks = []
    with LaunchCounter() as counter:
        marks: list[tuple[int, int]] = []

        def enter(*_: object) -> None:
            marks.append((counter.total(), _allocations(counter)))

        def leave(*_: object) -> None:
            total, alloc = marks.pop()
            per_layer.append(counter.total() - total)
            allocs.append(_allocations(counter) - alloc)

        for block in model.layers:
            hooks += [block.register_forward_pre_hook(enter), block.register_forward_hook(leave)]
        model(torch.randint(0, cfg.vocab_size, (batch,), generator=gen), meta, kv)
    for hook in hooks:
        hook.remove()
    kinds = [b.attn.kind for b in model.layers]
    out = {"per_layer": sum(per_layer) / len(per_layer), "whole_step": float(counter.total()),
           "triton_launches_per_layer": counter.ops["triton"] / len(per_layer),
           "allocations_per_layer": sum(allocs) / len(allocs)}
    for kind in sorted(set(kinds)):
        mine = [n for n, k in zip(per_layer, kinds, strict=True) if k == kind]
        out[f"{kind}_layer"] = sum(mine) / len(mine)
    return out


# Output allocations: ATen ops, so counted above, but served by the caching allocator without a launch.
ALLOCATIONS = ("aten.empty", "aten.empty_like", "aten.new_empty", "aten.empty_strided")


def _allocations(counter: LaunchCounter) -> int:
    return sum(counter.ops[name] for name in ALLOCATIONS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--context", type=int, default=300, help="tokens before the counted decode step")
    args = parser.parse_args()
    backends = ["torch"] + (["triton"] if triton_available() else [])
    model = build_tiny()
    rows, results = [], {}
    for backend in backends:
        kernels = load_kernels(backend)
        for batch in [int(b) for b in args.batch.split(",")]:
            counts = decode_step_counts(model, kernels, batch, args.context)
            results[f"{backend}_batch{batch}"] = counts
            rows.append([backend, batch, counts["per_layer"], counts["swa_layer"], counts["csa_layer"],
                         counts["hca_layer"], counts["triton_launches_per_layer"], counts["allocations_per_layer"],
                         counts["whole_step"]])
    if "triton_batch1" in results:
        for batch in args.batch.split(","):
            t, r = results[f"torch_batch{batch}"], results[f"triton_batch{batch}"]
            results[f"ratio_batch{batch}"] = t["per_layer"] / r["per_layer"]
    print_table(f"device work items of one decode step, tiny model, context {args.context} "
                "(non-view ATen ops + Triton launches)",
                ["backend", "batch", "per layer", "SWA layer", "CSA layer", "HCA layer", "of which Triton",
                 "of which allocations", "whole step"], rows)
    for batch in args.batch.split(","):
        if f"ratio_batch{batch}" in results:
            print(f"batch {batch}: torch / triton items per layer = {results[f'ratio_batch{batch}']:.2f}")
    write_results("bench_launches", results)


if __name__ == "__main__":
    main()
