"""Tensor parallelism on CPU ranks (gloo): the step time of 2 ranks against one process on the same
checkpoint, and the bytes each rank puts into collectives per decode step; then the serving engine
itself (rank 0 scheduling and broadcasting each step's plan to the other ranks) decoding batches of
1 and 16 against a single-process engine, with the plan's bytes per step, and again with decode steps
run from the decode graphs' static buffers (what a CUDA graph replays; uncaptured on the CPU), each
sent to the other ranks as one fixed-size message instead of a pickled plan.

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
import functools
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import decode_seconds, print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.parallel.ranks import SequenceCase, run_on_ranks, run_sequence  # noqa: E402
from v4serve.engine.model.parallel.sharding import ParallelConfig  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config  # noqa: E402
from v4serve.engine.model.weights.checkpoint import load_model, write_checkpoint  # noqa: E402
from v4serve.engine.process.rank_group import RankGroup  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.engine.step_plan import DecodeStep, StepPlan  # noqa: E402
from v4serve.server.cli import _parse_override  # noqa: E402
from v4serve.server.config import ServeConfig  # noqa: E402
from v4serve.server.model_loading import load  # noqa: E402

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
    payload["engine"] = engine_section(folder, args, prompt)
    write_results("bench_tp", payload)


def engine_section(folder: Path, args: argparse.Namespace, prompt: tuple[int, ...]) -> dict:
    """The serving engine decoding batches of 1 and 16: one process (all cores) against N ranks."""
    batches, out, rows = (1, 16), {}, []
    torch.set_num_threads(os.cpu_count() or 1)
    single = LLMEngine(load(ServeConfig(model=str(folder))), engine_config(max(batches)))
    for batch in batches:
        out[f"1 process, batch {batch}"] = {"decode_step_seconds": decode_step(single, batch, prompt, args.decode)}
    single.close()
    for static in (False, True):
        name = f"TP {args.ranks}" + (", static steps" if static else "")
        group, model = CountingRankGroup.spawn(ParallelConfig(args.ranks, rank=0),
                                               functools.partial(load, ServeConfig(model=str(folder))),
                                               torch.device("cpu"))
        engine = LLMEngine(model, engine_config(max(batches), static), ranks=group)
        for batch in batches:
            group.sent_bytes.clear()
            group.send_seconds.clear()
            seconds = decode_step(engine, batch, prompt, args.decode)
            decode_sends = group.sent_bytes[-(args.decode - 1):]
            send_seconds = sorted(group.send_seconds[-(args.decode - 1):])
            out[f"{name}, batch {batch}"] = {"decode_step_seconds": seconds,
                                             "bytes_per_step": sum(decode_sends) // len(decode_sends),
                                             "send_seconds_median": send_seconds[len(send_seconds) // 2]}
        engine.close()
    for batch in batches:
        base = out[f"1 process, batch {batch}"]["decode_step_seconds"]
        eager, static = out[f"TP {args.ranks}, batch {batch}"], out[f"TP {args.ranks}, static steps, batch {batch}"]
        rows.append([batch, 1e3 * base, 1e3 * eager["decode_step_seconds"], eager["decode_step_seconds"] / base,
                     1e3 * static["decode_step_seconds"], eager["bytes_per_step"], static["bytes_per_step"],
                     1e6 * eager["send_seconds_median"], 1e6 * static["send_seconds_median"],
                     static["send_seconds_median"] / eager["send_seconds_median"]])
    print_table(f"the serving engine, {args.decode} decodes per request after a {len(prompt)}-token prompt; static: "
                "decode steps from the graphs' buffers (uncaptured here; their tables padded to max_model_len, which "
                "the torch kernels score in full) sent as one fixed-size message; send: rank 0's time to hand a "
                "decode step to the other ranks (median)",
                ["batch", "1 process ms/step", f"TP {args.ranks} ms/step", "TP / 1", "static ms/step",
                 "pickled plan B", "message B", "send pickled us", "send message us", "message / pickled"], rows)
    return out


class CountingRankGroup(RankGroup):
    """Records the bytes of every step it broadcasts: a pickled plan, or a decode step's fixed-size message."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.sent_bytes: list[int] = []
        self.send_seconds: list[float] = []  # the whole hand-over: pickling (or packing) and broadcast

    def run_step(self, plan: StepPlan) -> None:
        start = time.perf_counter()
        super().run_step(plan)
        self.send_seconds.append(time.perf_counter() - start)
        self.sent_bytes.append(len(pickle.dumps(plan)))

    def run_decode(self, step: DecodeStep) -> bool:
        start = time.perf_counter()
        sent = super().run_decode(step)
        if sent:
            self.send_seconds.append(time.perf_counter() - start)
            self.sent_bytes.append(self._wire.buffer.numel() * self._wire.buffer.element_size())
        return sent


def engine_config(max_seqs: int, static: bool = False) -> EngineConfig:
    return EngineConfig(max_num_seqs=max_seqs, max_model_len=4096, enable_prefix_caching=False,
                        uncaptured_graphs=static)


def decode_step(engine: LLMEngine, batch: int, prompt: tuple[int, ...], decode: int) -> float:
    """Seconds per decode step of `batch` requests (distinct prompts: no sharing between them)."""
    params = SamplingParams(max_tokens=decode, ignore_eos=True)
    reqs = [Request(f"b{batch}-{i}", [(t + i) % 300 + 10 for t in prompt], params) for i in range(batch)]
    return decode_seconds(engine, reqs) / (decode - 1)


if __name__ == "__main__":
    main()
