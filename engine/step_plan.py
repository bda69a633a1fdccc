"""What a parallel engine's rank 0 sends its other ranks each step, and the KV writes it mirrors.

Under tensor/expert parallelism (engine/process/rank_group.py runs the ranks) every rank runs the
same forward pass; what only rank 0 does — the KV manager's slot clears, snapshot restores and
blocks read from the SSD store — reaches the others as recorded writes in each step's `StepPlan`,
so every rank holds the same KV bytes (`kv_digest` checks it). The engine drives the ranks through
`Ranks`, whatever starts them.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout
from v4serve.engine.model.metadata import AttentionMetadata
from v4serve.engine.mtp import MTPRows, MTPSeed

PARALLEL_STEP_TOKENS = 128  # steps with at least this many tokens use every intra-op CPU thread


def step_threads(num_tokens: int, max_threads: int) -> int:
    """CPU intra-op threads for a step: small (decode) steps run on one, the others would only spin
    against the serving threads; large (prefill) steps use them all."""
    return max_threads if num_tokens >= PARALLEL_STEP_TOKENS else 1


@dataclass(frozen=True)
class KVShape:
    """Enough for a worker to allocate a `DeviceKV` identical to rank 0's."""

    layout: KVLayout
    num_slots: int
    num_blocks: int
    dtype: torch.dtype


@dataclass
class StepPlan:
    kv_writes: list[tuple[str, tuple[Any, ...]]]  # `MirroredDeviceKV` calls, in order
    input_ids: list[int]
    meta: AttentionMetadata
    threads: int
    mtp_rows: list[MTPRows] = field(default_factory=list)  # the MTP layer takes them right after the pass


@dataclass
class MTPPass:
    """MTP work rank 0 does after sampling (engine/mtp.py), for every rank to do alike: the kept rows of
    the last pass whose drafts were all kept, or drafting from `seeds`; after the KV writes so far."""

    kv_writes: list[tuple[str, tuple[Any, ...]]]
    rows: list[MTPRows] = field(default_factory=list)
    seeds: list[MTPSeed] = field(default_factory=list)
    k: int = 0


class MirroredDeviceKV(DeviceKV):
    """Rank 0's DeviceKV: every write that does not come from the model (which every rank runs) is
    also recorded, with its host data (snapshots are never changed in place; store blocks are copied
    out of their larger buffer), for the next `StepPlan`. Recorded even when the write fails part-way,
    so the ranks attempt the same writes."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.writes: list[tuple[str, tuple[Any, ...]]] = []

    def clear_slot(self, slot: int) -> None:
        self.writes.append(("clear_slot", (slot,)))
        super().clear_slot(slot)

    def write_slot(self, slot: int, state: torch.Tensor | list[torch.Tensor]) -> None:
        host = state.to("cpu") if isinstance(state, torch.Tensor) else [t.to("cpu") for t in state]
        self.writes.append(("write_slot", (slot, host)))
        super().write_slot(slot, state)

    def install_blocks(self, block_ids: list[int], stacked: list[torch.Tensor]) -> None:
        n = len(block_ids)  # `stacked` are views of a larger host matrix: send only these rows
        self.writes.append(("install_blocks", (list(block_ids), [t[:n].to("cpu", copy=True) for t in stacked])))
        super().install_blocks(block_ids, stacked)

    def take_writes(self) -> list[tuple[str, tuple[Any, ...]]]:
        writes, self.writes = self.writes, []
        return writes


def replay_writes(kv: DeviceKV, writes: list[tuple[str, tuple[Any, ...]]]) -> None:
    for name, args in writes:
        getattr(DeviceKV, name)(kv, *args)


def kv_digest(kv: DeviceKV) -> str:
    h = hashlib.sha256()
    for layer in kv.layers:
        for t in (*layer.slot_tensors(), *layer.block_tensors()):
            h.update(t.contiguous().view(-1).view(torch.uint8).cpu().numpy().tobytes())
    return h.hexdigest()


class Ranks(Protocol):
    """The other ranks of a parallel engine, as rank 0's engine drives them."""

    broken: bool  # a step failed part-way: the ranks may wait in different collectives

    def start(self, shape: KVShape) -> None:
        """Workers allocate their DeviceKV like rank 0's."""

    def run_step(self, plan: StepPlan) -> None:
        """Send the step; the caller then runs the same forward pass as every worker."""

    def run_mtp(self, work: MTPPass) -> None:
        """Send MTP work; the caller then does the same as every worker."""

    def kv_digests(self, kv: MirroredDeviceKV) -> list[str]:
        """sha256 of every rank's whole DeviceKV, rank 0 first."""

    def dead_rank(self) -> str | None:
        """Which rank has exited, and how; None while all run."""

    def kill(self) -> None: ...

    def stop(self) -> None:
        """Workers leave their loop and exit; then the group is torn down."""
