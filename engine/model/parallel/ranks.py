"""Run one sequence on N ranks, each holding its shard of a checkpoint: the simplest driver of the
parallel model (tests, benchmarks), as `single.SingleSequence` is of the single-process one.

`run_on_ranks` spawns N processes (torch.multiprocessing, gloo over TCP on 127.0.0.1), each loading
its shard and running the same steps through `SingleSequence` with the same metadata; rank 0's
results come back. Several cases share one spawn: starting ranks costs seconds. The ranks meet
through a store the parent hosts on a port the OS gives it while binding: a port chosen first and
bound later can be taken in between by any other process (a loaded CI machine does it), and the
ranks then abort in their rendezvous.
"""

from __future__ import annotations

import hashlib
import tempfile
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from v4serve.engine.model.parallel.sharding import TRAFFIC, ParallelConfig, default_threads
from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.model.weights.checkpoint import load_model
from v4serve.engine.model.weights.packed import resident_bytes
from v4serve.kernels.registry import load_kernels


@dataclass(frozen=True)
class SequenceCase:
    """A checkpoint, how to split it, and the steps: the prompt in chunks of `chunk` tokens (all
    logits kept), then `decode_steps` greedy decodes."""

    folder: str
    expert_parallel: bool = False
    packed: bool = False
    prompt: tuple[int, ...] = ()
    chunk: int = 64
    decode_steps: int = 0


@dataclass
class SequenceResult:
    logits: torch.Tensor  # [len(prompt) + decode_steps, V]: prompt rows, then each decode's
    tokens: list[int]  # the greedy tokens of the decode steps
    resident_bytes: list[int]  # each rank's parameters and buffers
    kv_digests: list[str]  # each rank's whole DeviceKV (sha256): every rank must hold the same bytes
    prefill_seconds: float = 0.0  # wall time of the chunked prompt (rank 0)
    decode_seconds: float = 0.0  # mean wall time of one decode step (rank 0)
    decode_traffic: dict[str, int] = field(default_factory=dict)  # rank 0's collective bytes per decode step


def run_sequence(model: torch.nn.Module, case: SequenceCase) -> SequenceResult:
    """The case's steps on one model (a rank's shard or a whole model): the same code for both."""
    model.use_kernels(load_kernels("torch"))
    seq = SingleSequence(model, len(case.prompt) + case.decode_steps + 1)
    start = time.perf_counter()
    parts = [seq.prefill(list(case.prompt), chunk=case.chunk)]
    prefill = time.perf_counter() - start
    tokens: list[int] = []
    elapsed = 0.0
    TRAFFIC.reset()
    for _ in range(case.decode_steps):
        tokens.append(int(parts[-1][-1].argmax()))
        start = time.perf_counter()
        parts.append(seq.step([tokens[-1]]))
        elapsed += time.perf_counter() - start
    steps = max(case.decode_steps, 1)
    traffic = {"all_reduce": TRAFFIC.all_reduce_bytes // steps, "all_gather": TRAFFIC.all_gather_bytes // steps,
               "calls": TRAFFIC.calls // steps}
    return SequenceResult(torch.cat(parts), tokens, [resident_bytes(model)], [_kv_digest(seq)], prefill,
                          elapsed / steps, traffic)


def _kv_digest(seq: SingleSequence) -> str:
    h = hashlib.sha256()
    for layer in seq.device_kv.layers:
        for t in (*layer.slot_tensors(), *layer.block_tensors()):
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def run_on_ranks(cases: list[SequenceCase], ranks: int, threads: int | None = None) -> list[SequenceResult]:
    """Each case on `ranks` processes (tensor parallel size `ranks`); rank 0's results, with every
    rank's resident bytes."""
    store = dist.TCPStore("127.0.0.1", 0, ranks, is_master=True, wait_for_workers=False, timeout=RENDEZVOUS)
    with tempfile.TemporaryDirectory(prefix="v4serve-ranks-") as tmp:
        out = Path(tmp) / "results.pt"
        mp.spawn(_rank_main, args=(ranks, store.port, cases, str(out), threads or default_threads(ranks)),
                 nprocs=ranks, join=True)
        return torch.load(out, weights_only=False)


# Generous: under heavy load starting a rank (importing torch) takes long, and a short limit is a flake.
RENDEZVOUS = timedelta(minutes=10)


def _rank_main(rank: int, ranks: int, port: int, cases: list[SequenceCase], out: str, threads: int) -> None:
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, ranks, is_master=False, timeout=RENDEZVOUS)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=ranks, timeout=RENDEZVOUS)
    try:
        results = []
        for case in cases:
            parallel = ParallelConfig(ranks, case.expert_parallel, rank)
            model = load_model(case.folder, packed=case.packed, parallel=parallel, progress=False)
            result = run_sequence(model, case)
            facts: list[tuple[list[int], list[str]] | None] = [None] * ranks
            dist.all_gather_object(facts, (result.resident_bytes, result.kv_digests))
            result.resident_bytes = [rank_facts[0][0] for rank_facts in facts if rank_facts]
            result.kv_digests = [rank_facts[1][0] for rank_facts in facts if rank_facts]
            results.append(result)
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()
