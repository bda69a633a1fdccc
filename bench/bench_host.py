"""Host work per decode step: the real engine-core loop (drain commands, `engine.step()` — schedule,
metadata, sampling, update —, emit outputs, publish the step over ZeroMQ) with the forward pass
replaced by a stand-in that returns fixed logits, so what is measured is the host's part of a step
alone: the CPU time of the engine thread per step, per sequence, and the worst step against the median.

Batches of greedy requests (~1K-token prompts, `ignore_eos`) decode on the tiny model's engine; each
batch size is measured over `--steps` decode steps once every request is decoding. Prefix caching is on
(its bookkeeping is part of every step); `--store` adds the SSD store in a temporary folder.

    python bench/bench_host.py [--batches 1 32 64 128 256] [--steps 200] [--context 1024] [--store] [--gc]
                               [--penalties] [--results NAME]

`--device-ms 5 10 20` runs the engine against a simulated device instead: each forward queues that
much device time behind the steps already queued and returns at once (as a launch on a CUDA stream
does), and the copy of a step's samples to the host waits until that step has run. It reports decode
tokens/s as a fraction of the device-bound ideal (batch / device step), with steps in series and
launched ahead (`--async-scheduling`), side by side.

    python bench/bench_host.py --device-ms 5 10 20 [--batches 1 32 64 128 256] [--steps 100]
"""

from __future__ import annotations

import argparse
import gc
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.v4.tiny import build_tiny  # noqa: E402
from v4serve.engine.process.core import EngineCore  # noqa: E402
from v4serve.engine.process.lifecycle import freeze_startup_objects  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402
from v4serve.engine.sampler import HostCopy  # noqa: E402

# `--penalties`: every request penalised (their counts are kept on the device between steps).
PENALTIES = {"repetition_penalty": 1.1, "frequency_penalty": 0.2, "presence_penalty": 0.1}
DRAIN = """
import sys, zmq
pull = zmq.Context().socket(zmq.PULL)
pull.connect(sys.argv[1])
while True:
    pull.recv(copy=False)
"""
# Output tokens a request may make: past the steps measured, whatever the batch's prefill took.
LONGEST = 4096


class StandInForward:
    """The model's forward, minus the model: the step's metadata is built as for a real pass (the
    engine's `AttentionMetadata`, the forward's `RaggedBatch`), the slot states at snapshot points inside
    a prefill chunk are handed over unchanged, and the logits of its rows are fixed (token 65 wins
    everywhere; greedy requests never stop on their own)."""

    def __init__(self, vocab: int, rows: int) -> None:
        self.logits = torch.zeros(rows, vocab)
        self.logits[:, 65] = 1.0

    def __call__(self, input_ids: torch.Tensor, meta: Any, kv: Any, batch: Any = None) -> torch.Tensor:
        if batch is None:
            meta.ragged(input_ids.device)
        if meta.capture is not None:
            for layer in kv.layers:
                for seq in meta.capture.seqs:
                    points = len(seq.points)
                    seq.states[id(layer)] = [ring[seq.slot].unsqueeze(0).repeat(points, *[1] * (ring.dim() - 1))
                                             for ring in layer.slot_tensors()]
        return self.logits[:len(meta.logits_rows)]


class SimulatedDevice:
    """A stand-in for a GPU's stream, as a timeline: each step queued runs `step_s` after the later of
    now and the end of the steps queued before it; the host returns from a launch at once and waits only
    when it reads a step's results."""

    current: SimulatedDevice | None = None  # the one the sampler's copies wait for (`simulate`)

    def __init__(self, step_s: float) -> None:
        self.step_s = step_s
        self.free_at = 0.0  # when the steps queued so far have all run

    def queue_step(self) -> None:
        self.free_at = max(time.perf_counter(), self.free_at) + self.step_s

    @staticmethod
    def wait_until(when: float) -> None:
        while (left := when - time.perf_counter()) > 0:
            time.sleep(left)


def simulate() -> None:
    """The sampler's copies to the host wait for the step they follow (the one queued last on
    `SimulatedDevice.current`)."""
    start = HostCopy.start.__func__  # type: ignore[attr-defined]

    def queued_start(cls: type[HostCopy], result: torch.Tensor) -> HostCopy:
        copy = start(cls, result)
        assert SimulatedDevice.current is not None
        copy.ready_at = SimulatedDevice.current.free_at  # type: ignore[attr-defined]
        return copy

    def wait(copy: HostCopy) -> torch.Tensor:
        SimulatedDevice.wait_until(copy.ready_at)  # type: ignore[attr-defined]
        return copy.host

    HostCopy.start = classmethod(queued_start)  # type: ignore[method-assign, assignment]
    HostCopy.wait = wait  # type: ignore[method-assign]


class MeasuredCore(EngineCore):
    """The engine core, timing the engine thread's CPU between consecutive published steps."""

    def __init__(self, engine: LLMEngine, to_front: zmq.Socket, batch: int) -> None:
        super().__init__(engine, [to_front])
        self.batch = batch
        self.cpu: list[float] = []  # seconds of engine-thread CPU per decode step of the full batch
        self.wall: list[float] = []  # and of wall time
        self.outside: list[float] = []  # and of it, what was spent outside `engine.step()` (the output path)
        self.step_cpu = 0.0  # engine-thread CPU inside `engine.step()` since the last published step
        self._last: float | None = None
        self._last_wall = 0.0
        self.done = threading.Event()
        self.wanted = 0

    def _flush(self, stats: Any) -> None:
        super()._flush(stats)
        now, wall = time.thread_time(), time.perf_counter()
        running = self.engine.scheduler.running
        decoding = len(running) == self.batch and all(r.output_token_ids for r in running)
        if decoding and self._last is not None and len(self.cpu) < self.wanted:
            self.cpu.append(now - self._last)
            self.wall.append(wall - self._last_wall)
            self.outside.append(now - self._last - self.step_cpu)
            if len(self.cpu) == self.wanted:
                self.done.set()
        self._last, self._last_wall = (now if decoding else None), wall
        self.step_cpu = 0.0

    def timed(self, step: Any) -> Any:
        """`engine.step`, its engine-thread CPU counted (the rest of a loop turn is the output path:
        outputs handed to their choices, the stats snapshot, the step encoded and sent)."""
        def run() -> Any:
            start = time.thread_time()
            try:
                return step()
            finally:
                self.step_cpu += time.thread_time() - start
        return run


def measure(batch: int, steps: int, context: int, store: Path | None, frozen: bool = True,
            penalties: bool = False, device: SimulatedDevice | None = None, ahead: bool = False) -> dict[str, float]:
    model = build_tiny(seed=0)
    config = EngineConfig(max_model_len=context + LONGEST, max_num_seqs=batch, max_num_batched_tokens=8192,
                          max_prefill_chunk=8192, kv_store_dir=str(store) if store else None,
                          async_scheduling="on" if ahead else "off")
    engine = LLMEngine(model, config)
    forward = StandInForward(model.cfg.vocab_size, max(batch, 8192))
    if device is not None:
        SimulatedDevice.current = device

        def launch(*args: Any, **kwargs: Any) -> torch.Tensor:
            logits = forward(*args, **kwargs)
            device.queue_step()
            return logits

        model.forward = launch  # type: ignore[method-assign]
    else:
        model.forward = forward  # type: ignore[method-assign]
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    folder = tempfile.mkdtemp(prefix="bench-host-")
    address = f"ipc://{folder}/steps"
    push.bind(address)
    # The front end's side, in a process of its own as in the daemon (a thread here would contend for
    # the engine thread's GIL): every step's message is received and dropped.
    reader = subprocess.Popen([sys.executable, "-c", DRAIN, address])
    if frozen:
        freeze_startup_objects()  # as the engine process does once built
    else:
        gc.unfreeze()  # Python's default: every full collection scans every object
    core = MeasuredCore(engine, push, batch)
    engine.step = core.timed(engine.step)  # type: ignore[method-assign]
    core.wanted = steps
    core.loop.start()
    gen = torch.Generator().manual_seed(batch)
    requests = [Request(f"r{i}", torch.randint(70, model.cfg.vocab_size, (context,), generator=gen).tolist(),
                        SamplingParams(max_tokens=LONGEST, ignore_eos=True, **PENALTIES if penalties else {}))
                for i in range(batch)]
    core.loop.enqueue(requests, lambda out: core._outputs[0].append(("r", out)))  # noqa: SLF001 - as EngineCore does
    finished = core.done.wait(600)
    core.loop.abort([r.request_id for r in requests])
    core.loop.shutdown()
    reader.kill()
    reader.wait()
    shutil.rmtree(folder, ignore_errors=True)
    push.close(linger=0)
    ctx.term()
    assert finished, f"batch {batch}: fewer than {steps} decode steps measured"
    per_step = sorted(core.cpu)
    median = statistics.median(per_step)
    if device is not None:  # decode tokens/s over the device-bound ideal (batch tokens per device step)
        return {"batch": batch, "device_ms": device.step_s * 1e3, "ahead": ahead,
                "of_ideal": device.step_s * len(core.wall) / sum(core.wall), "host_ms": median * 1e3}
    outside = statistics.median(core.outside)
    return {"batch": batch, "median_step_ms": median * 1e3, "per_seq_us": median / batch * 1e6,
            "output_path_us_per_token": outside / batch * 1e6,
            "p99_step_ms": per_step[int(0.99 * (len(per_step) - 1))] * 1e3, "worst_step_ms": per_step[-1] * 1e3,
            "worst_over_median": per_step[-1] / median}


def overlap(batches: list[int], device_ms: list[float], steps: int, context: int) -> None:
    rows = []
    for ms in device_ms:
        for batch in batches:
            series, ahead = (measure(batch, steps, context, None, device=SimulatedDevice(ms / 1e3), ahead=a)
                             for a in (False, True))
            rows.append({"batch": batch, "device_ms": ms, "in_series": series["of_ideal"],
                         "ahead": ahead["of_ideal"], "host_ms_in_series": series["host_ms"],
                         "host_ms_ahead": ahead["host_ms"]})
    print_table(f"decode tokens/s over the device-bound ideal (simulated device; {context}-token prompts)",
                ["batch", "device step ms", "in series", "launched ahead", "host ms/step in series",
                 "host ms/step ahead"],
                [[r["batch"], r["device_ms"], r["in_series"], r["ahead"], r["host_ms_in_series"],
                  r["host_ms_ahead"]] for r in rows])
    write_results("host-overlap", {"context": context, "steps": steps, "rows": rows})


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 64, 128, 256])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--store", action="store_true", help="the SSD store on, in a temporary folder")
    parser.add_argument("--gc", action="store_true", help="each batch again with the start-up objects not "
                                                           "frozen (the collector's full passes scan them all)")
    parser.add_argument("--penalties", action="store_true", help="every request with repetition, frequency "
                                                                 "and presence penalties")
    parser.add_argument("--device-ms", type=float, nargs="+", help="a simulated device taking this long per "
                                                                    "step: tokens/s in series and launched ahead")
    parser.add_argument("--results", help="the results file's name in bench/results (default host, host-store)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.device_ms:
        simulate()
        overlap(args.batches, args.device_ms, args.steps, args.context)
        return
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for batch in args.batches:
            store = Path(folder) / f"store-{batch}" if args.store else None
            row = measure(batch, args.steps, args.context, store, penalties=args.penalties)
            if args.gc:  # the same batch with the start-up objects left to the collector, right after
                unfrozen = measure(batch, args.steps, args.context, store and store.with_name(store.name + "-gc"),
                                   frozen=False)
                row["unfrozen_worst_over_median"] = unfrozen["worst_over_median"]
            rows.append(row)
    header = ["batch", "median step ms", "per sequence us", "of which output path", "p99 step ms", "worst step ms",
              "worst / median"]
    header += ["worst / median, objects not frozen"] if args.gc else []
    print_table(f"host CPU per decode step (stand-in forward; {args.context}-token prompts"
                f"{', SSD store on' if args.store else ''}{', penalties' if args.penalties else ''})", header,
                [[r["batch"], r["median_step_ms"], r["per_seq_us"], r["output_path_us_per_token"], r["p99_step_ms"],
                  r["worst_step_ms"],
                  r["worst_over_median"], *([r["unfrozen_worst_over_median"]] if args.gc else [])] for r in rows])
    write_results(args.results or ("host-store" if args.store else "host"),
                  {"context": args.context, "steps": args.steps, "store": args.store, "penalties": args.penalties,
                   "rows": rows})


if __name__ == "__main__":
    main()
