"""Tensor and expert parallelism of the model: which rank holds which part of each weight, and the
collectives that put the parts back together (`torch.distributed`: NCCL on GPUs, gloo on CPUs, by
the same code).

**The split** (the rules `engine/model/plan.py` already counts bytes by; its `check_parallel`
refuses sizes that do not divide). With N = `tensor_parallel_size` ranks, rank r holds:

* attention: its H/N query heads (`wq_b` rows, `attn_sink`), its o_groups/N output groups (`wo_a`
  rows) and their `wo_b` input columns; each rank's `wo_b` output is a partial sum → all-reduce.
  The indexer: its index heads (`indexer.wq_b` rows, `weights_proj` rows); the scores
  Σ_h w·relu(q·k) are partial sums over heads, all-reduced before the top-k, so every rank picks the
  same entries.
* MoE: the shared experts' intermediate channels (w1/w3 rows, w2 columns) and, without expert
  parallelism, the routed experts' likewise; with it (`expert_parallel`) E/N whole routed experts.
  The routed and shared outputs are added locally, then all-reduced once.
* embedding and head by vocabulary rows (⌈V/N⌉ per rank, the last rank fewer): the embedding looks
  up the ids in its rows (zero elsewhere) and all-reduces; the head's logits are all-gathered, so
  every rank holds the full logits (any rank could sample; the engine samples on rank 0).
* replicated: `wq_a`, `wkv`, `q_norm`, `kv_norm`, the compressors (the indexer's too) with their
  `ape`, the router (`gate` weight, bias, `tid2eid`), every norm and the mHC (`hc_*`) parameters.
  Every rank computes them on identical inputs (all-reduce and all-gather give every rank the same
  bits), so the replicated state stays identical across ranks.

**KV.** V4 has one latent KV head shared by all query heads: every rank holds the whole KV cache
(its own `DeviceKV`, same layout, same block ids and State Cache slots) and writes the same bytes
into it; each rank's attention reads it for its own heads.

**Expert dispatch.** Every rank runs the router on every token; a rank runs only the (token, expert)
pairs whose expert it holds, the others contribute zero locally, and the all-reduce of the MoE
output is the combine. Simple and exact, but each rank's all-reduce carries every token. A GPU
deployment at scale would use all-to-all instead: send each token only to the ranks holding its
chosen experts, and send the weighted results back (DeepEP-style), which moves k/N of the tokens
rather than all of them; the model's interface (`kernels.experts` with pairs marked remote) stays
the same.

Partial sums are all-reduced in fp32 (bf16 partial sums would round once per rank); the embedding's
all-reduce adds zeros to the one rank's rows that hold each id, exact in any dtype, so it runs in
the model dtype.

**How the engine drives the ranks** (engine/process/rank_group.py, engine/step_plan.py). One engine
process per rank, in the default process group (the daemon spawns them on one node; `torchrun`
starts them on several). Rank 0 owns the scheduler, the KV manager (block pool, hash chain, State
Cache slots), the SSD store and the sampler; worker ranks hold only a model shard and their own
`DeviceKV`, and loop: receive a step, run it, repeat. Each step rank 0 broadcasts one small pickled
`StepPlan` on a gloo group of its own, before any tensor collective of the step:

1. the KV manager's device writes since the last step, in order, so every rank's `DeviceKV` stays
   bitwise identical to rank 0's: slot resets, snapshot restores and blocks read from the SSD store,
   payload included (rank 0 reads the file once; the KV is unsharded);
2. the step's token ids [T] and its `AttentionMetadata`;
3. nothing else: every rank then runs `model(ids, meta, kv)`; the logits come back all-gathered,
   rank 0 samples and the next step's ids carry the sampled tokens.

Snapshots written to the SSD store are read from rank 0's `DeviceKV` only (all ranks hold the same
bytes). A rank that dies breaks the next collective; the engine turns that into a 503 and an exit.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.plan import check_parallel, routed_expert_of, tp_split_axis
from v4serve.engine.model.weights.layout import TensorSlice


@dataclass(frozen=True)
class ParallelConfig:
    """Which rank of how many this process is, and how the experts are divided."""

    tensor_parallel_size: int = 1
    expert_parallel: bool = False  # routed experts divided whole (E/N per rank) instead of by width
    rank: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.rank < max(self.tensor_parallel_size, 1):
            raise ValueError(f"rank {self.rank} is not one of the {self.tensor_parallel_size} ranks")

    @property
    def size(self) -> int:
        return self.tensor_parallel_size

    @property
    def splits_experts(self) -> bool:
        """True when routed experts are divided whole across more than one rank."""
        return self.expert_parallel and self.size > 1

    def check(self, cfg: ModelConfig) -> None:
        """Refuse sizes that would leave a rank part of a head, group or expert (the plan's check)."""
        check_parallel(cfg, self.size, self.expert_parallel)

    def span(self, n: int) -> tuple[int, int]:
        """This rank's [start, stop) of n things split in ⌈n/N⌉ chunks (the last rank may get fewer)."""
        chunk = -(-n // self.size)
        return min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)

    def part(self, n: int) -> int:
        """How many of n evenly split things this rank holds (n divisible by N: `check`)."""
        return n // self.size


def local(parallel: ParallelConfig | None) -> ParallelConfig | None:
    """None for a single process (size 1 builds today's modules, no collectives)."""
    return parallel if parallel is not None and parallel.size > 1 else None


class RankShard:
    """The loader's view of one rank's part of a checkpoint (engine/model/weights/layout.py `Sharding`): which
    official tensors it holds and which slice of each. The split rules are the plan's (`tp_split_axis`,
    `routed_expert_of`), so the capacity plan and the loader cannot disagree."""

    def __init__(self, cfg: ModelConfig, parallel: ParallelConfig) -> None:
        parallel.check(cfg)
        self.parallel = parallel
        self.experts = range(*parallel.span(cfg.n_routed_experts)) if parallel.splits_experts else None

    def holds(self, name: str) -> bool:
        expert = routed_expert_of(name)
        return self.experts is None or expert is None or expert in self.experts

    def slice_of(self, name: str, shape: tuple[int, ...]) -> TensorSlice | None:
        if self.experts is not None and routed_expert_of(name) is not None:
            return None  # a whole expert
        axis = tp_split_axis(name)
        if axis is None:
            return None
        return TensorSlice(axis, *self.parallel.span(shape[axis]))


# ---- collectives ---------------------------------------------------------------------------------


@dataclass
class Traffic:
    """Bytes this rank put into collectives since the last `reset` (payload sizes: a ring all-reduce
    of B bytes sends about 2(N−1)/N·B per rank, an all-gather (N−1)/N of its output)."""

    all_reduce_bytes: int = 0
    all_gather_bytes: int = 0
    calls: int = 0

    def reset(self) -> None:
        self.all_reduce_bytes = self.all_gather_bytes = self.calls = 0


TRAFFIC = Traffic()


def all_reduce_sum(x: torch.Tensor) -> torch.Tensor:
    """Partial sums [..] of every rank → their sum, added in fp32, returned in x's dtype."""
    total = x.float() if x.dtype != torch.float32 else x.contiguous()
    TRAFFIC.all_reduce_bytes += total.numel() * total.element_size()
    TRAFFIC.calls += 1
    dist.all_reduce(total)
    return total.to(x.dtype)


def embed_shard(ids: torch.Tensor, weight: torch.Tensor, start: int) -> torch.Tensor:
    """ids [T] (the whole vocabulary), weight [V_r, D] (rows start..start+V_r) → embeddings [T, D]:
    each rank contributes the rows it holds, zero elsewhere; the sum over ranks is the lookup."""
    rows = ids - start
    mine = (rows >= 0) & (rows < weight.shape[0])
    out = weight[rows.clamp(0, weight.shape[0] - 1)] * mine[:, None].to(weight.dtype)
    TRAFFIC.all_reduce_bytes += out.numel() * out.element_size()
    TRAFFIC.calls += 1
    dist.all_reduce(out)  # exactly one rank holds each id: adding zeros is exact in any dtype
    return out


def gather_vocab(logits: torch.Tensor, vocab: int, chunk: int) -> torch.Tensor:
    """This rank's logits [R, V_r] (vocabulary rows r·chunk ...) → every rank's [R, V]. Shards are
    padded to `chunk` columns (the last rank may hold fewer rows) so all-gather sees equal sizes."""
    padded = torch.nn.functional.pad(logits, (0, chunk - logits.shape[1])) if logits.shape[1] < chunk else logits
    parts = [torch.empty_like(padded) for _ in range(dist.get_world_size())]
    TRAFFIC.all_gather_bytes += padded.numel() * padded.element_size() * len(parts)
    TRAFFIC.calls += 1
    dist.all_gather(parts, padded.contiguous())
    return torch.cat(parts, dim=1)[:, :vocab]


def default_threads(ranks: int) -> int:
    """CPU threads per rank so N ranks do not oversubscribe the cores this process may run on (a cpuset
    or `taskset` gives fewer than the machine has)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, cores // ranks)
