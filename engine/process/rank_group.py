"""Serving under tensor/expert parallelism: rank 0's engine drives the other ranks.

Rank 0 is the engine-core process: it owns the scheduler, the KV manager (block pool, hash chain,
State Cache slots), the SSD store and the sampler. Every other rank is a *worker*: a model shard and a
`DeviceKV` of the same shape as rank 0's, nothing else. Each engine step rank 0 broadcasts one
`StepPlan` — the KV manager's device writes since the last step (slot clears, snapshot restores,
blocks read from the SSD store, payload included) and the step's token ids and `AttentionMetadata` —
and then every rank runs the same forward pass, whose collectives (engine/model/parallel/sharding.py) meet.
Under decode graphs (`GraphSpec`: captured on CUDA by every rank alike) a decode step with nothing
else to mirror travels instead as one fixed-size `Wire` message, and each rank keeps the slots'
block tables on its device from the entries that changed.
So every rank holds the same block ids and slots and, since V4's single latent KV head is replicated,
the same KV bytes (`kv_digests` checks it). Snapshots and blocks written to the SSD store are read
from rank 0's copy.

Two process groups: the default one carries the model's all-reduce/all-gather (NCCL on GPUs, gloo
on CPUs); a gloo group of its own carries the plans, with a timeout long enough for an idle server
(workers wait in a broadcast between requests).

Launch: `RankGroup.spawn` starts the workers on this node (multiprocessing, `spawn`) and meets them
through a TCPStore it hosts; until every shard is loaded a watchdog ends the engine process (and the
workers) if a worker dies, so a startup fault is an exit, never a wait in a rendezvous. Under `torchrun` (several
nodes) the processes already exist: `RankGroup.join_from_env` takes rank and world size from the
environment, and ranks other than 0 run `worker_loop` without an HTTP server.

A rank that dies breaks the group for good (a collective half done cannot be resumed): rank 0's
engine turns any forward failure into `EngineUnhealthy`, and `dead_rank` tells the engine core
which worker exited so it can report it and leave; workers leave when rank 0's process is gone.
"""

from __future__ import annotations

import atexit
import logging
import multiprocessing
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from v4serve.cache.device_kv import DeviceKV
from v4serve.engine.model.gpu.decode_graphs import DecodeGraphs
from v4serve.engine.model.metadata import SeqChunk
from v4serve.engine.model.parallel.sharding import ParallelConfig, default_threads
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.mtp import MTPLayer
from v4serve.engine.process.lifecycle import describe_exit, leave, setup_subordinate
from v4serve.engine.step_plan import (
    DecodeStep,
    GraphSpec,
    KVShape,
    MirroredDeviceKV,
    MTPPass,
    StepPlan,
    Wire,
    kv_digest,
    replay_writes,
)
from v4serve.kernels.attention import SlotTables, upload

log = logging.getLogger(__name__)

STARTUP_SECONDS = 600.0  # workers must join within this (importing torch and CUDA can take a while)
STEP_TIMEOUT = timedelta(minutes=10)  # one collective of a step; a longer wait means a rank is stuck
IDLE_TIMEOUT = timedelta(days=365)  # the plans' group: workers wait there while the server is idle
POLL_SECONDS = 0.5
EXIT_GRACE = 5.0  # seconds to wait, after a collective broke, for the worker that left to be seen exited

# A model shard for a rank: (parallel config, local rank) → the model, kernels chosen.
LoadShard = Callable[[ParallelConfig, int], DeepseekV4]


# ---- what crosses from rank 0 ----------------------------------------------------------------------


@dataclass
class DigestKV:
    """Every rank applies the writes not yet sent, then answers with the sha256 of its whole DeviceKV."""

    kv_writes: list[tuple[str, tuple[Any, ...]]]


@dataclass(frozen=True)
class Stop:
    pass


# ---- rank 0 ----------------------------------------------------------------------------------------


class RankGroup:
    """Rank 0's handle on the worker ranks, once every rank holds its shard."""

    def __init__(self, parallel: ParallelConfig, control: Any, processes: list[Any]) -> None:
        self.parallel = parallel
        self._control = control
        self._processes = processes  # empty under torchrun: the launcher owns the processes
        self._stopped = False
        self._wire = Wire()  # sized for decode steps once there are graphs
        self._table_width = 0  # the graphs' (MTP work travels on the wire only where they run it)
        self._num_slots: int | None = None
        self._tokens: torch.Tensor | None = None  # the tokens in flight, padded to a fixed size
        self.broken = False  # a step failed part-way: the ranks may wait in different collectives

    @classmethod
    def spawn(cls, parallel: ParallelConfig, load_shard: LoadShard,
              device: torch.device) -> tuple[RankGroup, DeepseekV4]:
        """Start ranks 1..N-1 on this node, meet them, and load every shard (rank 0's is returned)."""
        if device.type == "cuda" and torch.cuda.device_count() < parallel.size:
            raise ValueError(f"--tensor-parallel-size {parallel.size} needs {parallel.size} GPUs on this node; "
                             f"{torch.cuda.device_count()} are visible (several nodes: launch with torchrun)")
        store = dist.TCPStore("127.0.0.1", 0, parallel.size, is_master=True, wait_for_workers=False,
                              timeout=timedelta(seconds=STARTUP_SECONDS))
        context = multiprocessing.get_context("spawn")
        threads = default_threads(parallel.size)
        processes = [context.Process(target=_spawned_worker, name=f"v4serve-rank{rank}", daemon=True,
                                     args=(ParallelConfig(parallel.size, parallel.expert_parallel, rank), store.port,
                                           load_shard, device, threads, os.getpid()))
                     for rank in range(1, parallel.size)]
        for p in processes:
            p.start()
        # Before multiprocessing's own exit hook, which would wait for workers that ignore SIGTERM.
        atexit.register(_kill, processes)
        loaded = threading.Event()
        threading.Thread(target=_watch_startup, args=(processes, loaded), daemon=True,
                         name="v4serve-rank-watch").start()
        try:
            _wait_joined(store, processes)
            local_device(device, 0)
            dist.init_process_group(_backend(device), store=store, rank=0, world_size=parallel.size,
                                    timeout=STEP_TIMEOUT)
            torch.set_num_threads(threads)
            return cls._load(parallel, load_shard, processes, 0, loaded)
        except BaseException:
            _kill(processes)
            raise
        finally:
            loaded.set()

    @classmethod
    def join_from_env(cls, parallel: ParallelConfig, load_shard: LoadShard,
                      device: torch.device) -> tuple[RankGroup, DeepseekV4]:
        """Rank 0 of a group `torchrun` launched (RANK, WORLD_SIZE, MASTER_ADDR/PORT in the environment)."""
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        local_device(device, local_rank)
        dist.init_process_group(_backend(device), init_method="env://", rank=0, world_size=parallel.size,
                                timeout=STEP_TIMEOUT)
        return cls._load(parallel, load_shard, [], local_rank, threading.Event())

    @classmethod
    def _load(cls, parallel: ParallelConfig, load_shard: LoadShard, processes: list[Any], local_rank: int,
              loaded: threading.Event) -> tuple[RankGroup, DeepseekV4]:
        control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
        group = cls(parallel, control, processes)
        try:
            model, error = load_shard(parallel, local_rank), None
        except Exception as exc:  # the workers must hear it, or they would wait forever
            model, error = None, exc
        errors = group._gather(None if error is None else f"rank 0: {error}")
        loaded.set()  # from here a worker exiting (after a load error of its own) is expected
        failed = [e for e in errors if e is not None]
        if error is not None:
            raise error
        if failed:
            raise ValueError("; ".join(failed))
        assert model is not None
        return group, model

    def _gather(self, value: Any) -> list[Any]:
        out: list[Any] = [None] * self.parallel.size
        try:
            dist.all_gather_object(out, value, group=self._control)
        except Exception as exc:
            raise RuntimeError(f"a rank left the group while loading ({self._dead_rank_within(EXIT_GRACE) or exc})"
                               ) from exc
        return out

    def _dead_rank_within(self, seconds: float) -> str | None:
        """`dead_rank()`, waiting up to `seconds` for it: the others hear a dying worker's connection close
        before its exit status can be read, and the status says more than the broken collective does."""
        deadline = time.monotonic() + seconds
        while (dead := self.dead_rank()) is None and self._processes and time.monotonic() < deadline:
            time.sleep(0.02)
        return dead

    def _broadcast(self, message: object) -> None:
        dist.broadcast(self._wire.object_header(), src=0, group=self._control)
        dist.broadcast_object_list([message], src=0, group=self._control)

    def start(self, shape: KVShape) -> None:
        """Workers allocate their DeviceKV like rank 0's."""
        self._broadcast(shape)
        self._num_slots = shape.num_slots  # a step samples at most one row per slot: the tokens sent

    def run_step(self, plan: StepPlan) -> None:
        """Send the step; the caller then runs the same forward pass as every worker."""
        self._broadcast(plan)

    def run_decode(self, step: DecodeStep) -> bool:
        """Send a static decode step in one fixed-size message; False (nothing sent) where it does not
        fit one (send it as a `StepPlan`)."""
        if not self._wire.fits(step):
            return False
        dist.broadcast(self._wire.encode(step), src=0, group=self._control)
        return True

    def start_graphs(self, spec: GraphSpec) -> None:
        """Every rank builds (and captures) the same decode graphs as rank 0 is about to."""
        self._broadcast(spec)
        self._wire = Wire(max(spec.buckets), spec.row_width)
        self._table_width = spec.table_width

    def send_tokens(self, tokens: torch.Tensor) -> None:
        """The tokens in flight the step just sent places (on the device: a broadcast over the model's
        group, queued behind their sampling)."""
        assert self._num_slots is not None and len(tokens) <= self._num_slots
        if self._tokens is None or self._tokens.device != tokens.device:
            self._tokens = torch.zeros(self._num_slots, dtype=torch.long, device=tokens.device)
        self._tokens[:len(tokens)].copy_(tokens)
        dist.broadcast(self._tokens, src=0)

    def run_mtp(self, work: MTPPass) -> None:
        """Send MTP work (in the fixed-size message where the MTP layer's graphs run all of it: nothing
        pickled); the caller then does the same as every worker."""
        if self._wire.fits_mtp(work, self._table_width):
            dist.broadcast(self._wire.encode_mtp(work), src=0, group=self._control)
        else:
            self._broadcast(work)

    def kv_digests(self, kv: MirroredDeviceKV) -> list[str]:
        self._broadcast(DigestKV(kv.take_writes()))
        out: list[str | None] = [None] * self.parallel.size
        dist.gather_object(kv_digest(kv), out, dst=0, group=self._control)
        return [d or "" for d in out]

    def dead_rank(self) -> str | None:
        """Which spawned worker has exited, and how; None while all run (or under torchrun)."""
        for rank, p in enumerate(self._processes, start=1):
            if p.exitcode is not None:
                return f"rank {rank} (pid {p.pid}) exited: {describe_exit(p.exitcode)}"
        return None

    def kill(self) -> None:
        _kill(self._processes)

    def stop(self) -> None:
        """Workers leave their loop and exit; then the group is torn down."""
        if self._stopped:
            return
        self._stopped = True
        if self.dead_rank() is None and not self.broken:
            try:
                self._broadcast(Stop())
            except Exception:  # a rank is gone: nothing left to tell
                log.warning("could not tell every rank to stop")
            for p in self._processes:
                p.join(timeout=10)
        self.kill()
        if not self.broken:
            dist.destroy_process_group()


def _backend(device: torch.device) -> str:
    return "nccl" if device.type == "cuda" else "gloo"


def local_device(device: torch.device, local_rank: int) -> torch.device:
    """A rank's own device: GPU `local_rank` of this node, or the CPU."""
    if device.type != "cuda":
        return device
    torch.cuda.set_device(local_rank)  # before NCCL starts, so each rank's communicator uses its GPU
    return torch.device("cuda", local_rank)


def _kill(processes: list[Any]) -> None:
    for p in processes:
        if p.exitcode is None:
            p.kill()
            p.join(timeout=5)


def _watch_startup(processes: list[Any], loaded: threading.Event) -> None:
    """Until every shard is loaded: a worker that dies leaves rank 0 waiting in a rendezvous or a
    group's first collective, which nothing interrupts. End the engine process (and the other
    workers) instead; the front end reports its exit, and the worker's own error is in the log."""
    while not loaded.wait(POLL_SECONDS):
        for rank, p in enumerate(processes, start=1):
            if p.exitcode is not None and not loaded.wait(1.0):  # not an error rank 0 is about to report
                log.error("rank %d exited while starting (%s); the engine stops", rank, describe_exit(p.exitcode))
                _kill(processes)
                os._exit(1)


def _wait_joined(store: Any, processes: list[Any]) -> None:
    """Until every worker has said it joins the group; a worker that dies first is an error now,
    not a rendezvous timeout minutes later."""
    deadline = time.monotonic() + STARTUP_SECONDS
    keys = [f"joined/{rank}" for rank in range(1, len(processes) + 1)]
    while not store.check(keys):
        for rank, p in enumerate(processes, start=1):
            if p.exitcode is not None:
                raise RuntimeError(f"rank {rank} exited while starting ({describe_exit(p.exitcode)})")
        if time.monotonic() > deadline:
            raise RuntimeError(f"the ranks did not start within {STARTUP_SECONDS:.0f} s")
        time.sleep(0.05)


# ---- the other ranks ---------------------------------------------------------------------------------


def _spawned_worker(parallel: ParallelConfig, port: int, load_shard: LoadShard, device: torch.device, threads: int,
                    parent: int) -> None:
    """A worker this node's rank 0 started: joins through rank 0's store, leaves when rank 0 does."""
    setup_subordinate(f"v4serve-rank{parallel.rank}")
    _exit_with_parent(parent)
    torch.set_num_threads(threads)
    store = dist.TCPStore("127.0.0.1", port, parallel.size, is_master=False, timeout=timedelta(seconds=STARTUP_SECONDS))
    store.set(f"joined/{parallel.rank}", "1")
    device = local_device(device, parallel.rank)
    dist.init_process_group(_backend(device), store=store, rank=parallel.rank, world_size=parallel.size,
                            timeout=STEP_TIMEOUT)
    leave(worker_loop(parallel, load_shard, parallel.rank))


def worker_loop(parallel: ParallelConfig, load_shard: LoadShard, local_rank: int) -> int:
    """A worker's life once the default group is up: load the shard, then run every step rank 0
    sends until it says stop. Returns the exit status."""
    control = dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT)
    try:
        model, error = load_shard(parallel, local_rank), None
    except Exception as exc:
        log.exception("rank %d could not load its shard", parallel.rank)
        model, error = None, f"rank {parallel.rank}: {exc}"
    errors: list[str | None] = [None] * parallel.size
    dist.all_gather_object(errors, error, group=control)
    if model is None or any(errors):
        dist.destroy_process_group()
        return 1
    worker = _Worker(model, control)
    while worker.receive():
        pass
    dist.destroy_process_group()
    return 0


class _Worker:
    """A worker rank's state between steps: its model shard, its DeviceKV and, under decode graphs,
    the slots' block tables and the static steps."""

    def __init__(self, model: DeepseekV4, control: Any) -> None:
        self.model, self.control = model, control
        self.device = next(model.parameters()).device
        self.max_threads = torch.get_num_threads()
        self.wire = Wire()
        self.kv: DeviceKV | None = None
        self.mtp: MTPLayer | None = None
        self.last_pass: tuple[torch.Tensor, torch.Tensor] | None = None  # (states, ids): what MTP work reads
        self.graphs: DecodeGraphs | None = None
        self.tables: SlotTables | None = None  # the slots' block tables on the device, as rank 0's
        self.tokens: torch.Tensor | None = None  # rank 0's tokens in flight (async scheduling)

    def receive(self) -> bool:
        """Run the next thing rank 0 sends; False when it says stop."""
        dist.broadcast(self.wire.buffer, src=0, group=self.control)
        if self.wire.kind == Wire.DECODE:
            self._decode(self.wire.decode())
            return True
        if self.wire.kind in (Wire.MTP_COMMIT, Wire.MTP_PROPOSE):
            self._mtp(self.wire.decode_mtp())
            return True
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=self.control)
        message = box[0]
        if isinstance(message, Stop):
            return False
        if isinstance(message, KVShape):
            self.kv = DeviceKV(message.layout, message.num_slots, message.num_blocks, message.dtype, self.device)
            self.mtp = MTPLayer(self.model, self.kv, message.row_width) if message.layout.mtp_layers else None
            self.tokens = torch.zeros(message.num_slots, dtype=torch.long, device=self.device)
        elif isinstance(message, GraphSpec):
            self._start_graphs(message)
        elif isinstance(message, StepPlan):
            self._step(message)
        elif isinstance(message, MTPPass):
            self._mtp(message)
        elif isinstance(message, DigestKV):
            assert self.kv is not None
            replay_writes(self.kv, message.kv_writes)
            dist.gather_object(kv_digest(self.kv), None, dst=0, group=self.control)
        return True

    def _mtp(self, work: MTPPass) -> None:
        assert self.kv is not None and self.mtp is not None
        replay_writes(self.kv, work.kv_writes)
        if work.rows:
            assert self.last_pass is not None
            self.mtp.commit(work.rows, *self.last_pass)
        if work.seeds:
            self.mtp.propose(work.seeds, work.k)

    def _start_graphs(self, spec: GraphSpec) -> None:
        assert self.kv is not None
        self.tables = SlotTables(self.kv.num_slots, spec.table_width, self.device)
        self.graphs = DecodeGraphs(self.model, self.kv, spec.buckets, spec.table_width, spec.scratch_slot,
                                   spec.scratch_block, spec.capture, self.tables, spec.row_width, spec.states)
        if self.mtp is not None:  # the MTP layer's own graphs, captured after the main model's, as rank 0's are
            self.mtp.graphs = DecodeGraphs(self.model, self.kv, spec.buckets, spec.table_width, spec.scratch_slot,
                                           spec.scratch_block, spec.capture, self.tables, spec.row_width, mtp=True)
        self.wire = Wire(max(spec.buckets), spec.row_width)

    def _threads(self, threads: int) -> None:
        if self.device.type == "cpu":
            torch.set_num_threads(min(threads, self.max_threads))

    def _step(self, plan: StepPlan) -> None:
        assert self.kv is not None
        replay_writes(self.kv, plan.kv_writes)
        self.kv.keep_slots(plan.keep)  # after the writes: they may put back the last pass's kept slots
        if self.tables is not None and plan.table_writes[0]:
            self.tables.apply(*plan.table_writes)
        self._threads(plan.threads)
        fill = self._receive_tokens(plan.fill)
        if plan.static:
            assert self.graphs is not None
            out = self.graphs.run(plan.input_ids, plan.meta.seqs, fill)
            if self.mtp is not None:
                assert out.states is not None
                self.last_pass = (out.states, out.ids)
                self.mtp.commit(plan.mtp_rows, *self.last_pass)
            return
        ids = torch.tensor(plan.input_ids, dtype=torch.long, device=self.device)
        if fill is not None:
            fill(ids)
        if self.mtp is None:
            self.model(ids, plan.meta, self.kv)
        else:
            self.last_pass = (self.model.forward_states(ids, plan.meta, self.kv)[1], ids)
            self.mtp.commit(plan.mtp_rows, *self.last_pass)

    def _decode(self, step: DecodeStep) -> None:
        assert self.graphs is not None and self.tables is not None and self.kv is not None
        if step.table_writes[0]:
            self.tables.apply(*step.table_writes)
        self.kv.keep_slots(step.kept_slots)
        self._threads(step.threads)
        seqs = [SeqChunk(slot=slot, block_table=_TABLES_ON_DEVICE, start=start, num_new=n, frozen_until=frozen,
                         window_from=floor)
                for slot, start, floor, frozen, n in zip(step.slots, step.starts, step.window_from, step.frozen_until,
                                                         step.rows, strict=True)]
        out = self.graphs.run(step.input_ids, seqs, self._receive_tokens(step.fill))
        if self.mtp is not None:  # what the layer takes of the pass once its drafts are judged (`MTPPass`)
            assert out.states is not None
            self.last_pass = (out.states, out.ids)

    def _receive_tokens(self, fill: tuple[list[int], list[int]]) -> Callable[[torch.Tensor], None] | None:
        """Receive rank 0's tokens in flight (when the step has any: rank 0 sends them right after the
        step) → what writes them into the step's token ids."""
        places, rows = fill
        if not places:
            return None
        assert self.tokens is not None
        dist.broadcast(self.tokens, src=0)
        taken = self.tokens.index_select(0, upload(rows, self.device))
        return lambda ids: ids.index_copy_(0, upload(places, self.device), taken)


_TABLES_ON_DEVICE: list[int] = []  # a static step gathers its tables from the slots' rows


def _exit_with_parent(parent: int) -> None:
    """A worker never outlives rank 0's process (kill -9 of the engine core included)."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(POLL_SECONDS)
        os._exit(0)

    threading.Thread(target=watch, daemon=True, name="v4serve-parent-watch").start()
