"""A step-time model on paper: PREDICTED, NOT MEASURED. Each kernel's and each decode step's time of
DeepSeek-V4-Flash and -Pro on H100 SXM, H200 and B200, at tensor parallel 1, 4 and 8 (where the
capacity plan says the model fits), batch 1, 32 and 256, at one context (8K by default), eager and
with CUDA graphs, for v4serve's Triton decode path as the code stands.

Inputs, none of them measured on a GPU but mHC's floor (below):

* every weight, its shape and stored dtype (`engine/model/plan.py`: `checkpoint_tensors` of
  `aot.reduced_config`, one layer of each kind), held per rank by the plan's split rules and
  resident as the plan counts it (FP8/FP4 codes and scales where the kernels read them packed,
  bf16 otherwise); the routed experts a batch of B tokens touches, E·(1−(1−k/E)^B) of E;
* the KV each sequence reads (window 128 keys; CSA: top-k entries and the indexer's ctx/4 keys of
  128 channels; HCA: ctx/128 entries; a key is 1024 bytes in bf16 or an FP8 record of 584:
  `cache/layout.py`), and the State Cache rows a step writes;
* FLOPs: 2 per weight value per token for the projections, the active experts only for the MoE,
  the attention's and the indexer's dot products;
* device work items per layer kind and per step, counted by running one decode step at the real
  shapes on the `meta` device (nothing runs; `engine/model/gpu/aot.py`) and attributed to the kernels
  below: ATen ops (with the casts and copies that inference mode presents as views:
  `kernels.launches.is_work`), Triton launches and NCCL calls; `--stored-launches` uses
  the counts stored here instead (fast; what the test uses);
* the collectives of `engine/model/parallel/sharding.py`: two all-reduces per layer (attention output, MoE
  output), one more per CSA layer (the indexer's scores), the embedding's all-reduce and the
  logits' all-gather.

Each kernel's time = max(bytes / achievable HBM bandwidth, FLOPs / achievable peak, what one program
of its grid must move or compute on one SM) + collective time + per-launch overhead; a step is the
sum over every layer's kernels and the per-step kernels. The one-program term is an addition to
bytes/BW: two decode kernels have grids that do not grow with the GPU (`sparse_attention`: one
program per token and 16 heads, no split over keys; the MoE's per-expert tiles), so at small batch
they cannot use the whole HBM. mHC's time a call is floored by what one H200 measured (`MHC_CALL_S`:
its loops are latency-bound, which neither bytes nor FLOPs capture; the one input measured on a GPU).
Eager adds the host's cost of every work item to the device time (the GPU waiting on each launch).
Launch and collective costs are published measurements (cited at their constants); the engine's own
host work per step is bench/bench_host.py's. "v4serve" is the step as the code runs it: CUDA graphs
(on every rank under tensor parallelism) with async scheduling, the larger of the host's step and the
device's. Output per case: ms per step, tokens/s per GPU (B / step time / TP), the kernel with the
largest share of the step. Then the published peer figures beside v4serve's prediction. Not modelled: prefill (only a
compute floor for the peers' TTFT), speculative decoding, expert parallelism, and under tensor
parallelism rank 0's broadcast of each step's fixed-size message (bench/bench_tp.py measures it).
Written to bench/results/gpu_model.json.

    .venv/bin/python bench/gpu_model.py [--context 8192] [--kv-cache-dtype auto|fp8] [--stored-launches]
                                        [--models ...] [--gpus ...] [--tp 1,4,8] [--batches 1,32,256]
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import re
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_launches import ALLOCATIONS  # noqa: E402
from bench.common import print_table, write_results  # noqa: E402
from v4serve.cache.device_kv import DeviceKV  # noqa: E402
from v4serve.cache.layout import KVLayout, LayerLayout, key_record  # noqa: E402
from v4serve.engine.model.config import ModelConfig  # noqa: E402
from v4serve.engine.model.gpu.aot import Scenario, Step, meta_model, reduced_config, run_step  # noqa: E402
from v4serve.engine.model.parallel import sharding as parallel_module  # noqa: E402
from v4serve.engine.model.plan import (  # noqa: E402
    GIB,
    CapacityPlan,
    PlanSettings,
    StoredTensor,
    checkpoint_tensors,
    plan_model,
    preset_config,
    tp_split_axis,
)
from v4serve.engine.model.v4 import model as model_module  # noqa: E402
from v4serve.engine.model.weights.resident import can_stay_quantized, held_in_fp32  # noqa: E402
from v4serve.kernels.launches import LaunchRecorder, is_work  # noqa: E402

MODELS = ("deepseek-v4-flash", "deepseek-v4-pro")
TPS = (1, 4, 8)
BATCHES = (1, 32, 256)
CONTEXT = 8192  # tokens before the decoded one (the peer figures' 8K prompts)
ACT = 2  # bytes of an activation, and of every weight the plan holds unpacked: bf16 on a GPU

# ---------------------------------------------------------------------------------------------
# Hardware (datasheet figures; dense, i.e. without 2:4 sparsity, which the datasheets quote doubled)


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_gib: float  # as the capacity plan takes it (`--gpu-memory`, README's examples: 80 and 141)
    hbm_tb_s: float
    sms: int
    bf16_tflops: float  # tensor cores, dense
    fp8_tflops: float
    fp4_tflops: float | None
    fp32_tflops: float  # CUDA cores: torch's fp32 matmul at its default precision ("highest": no TF32)
    nvlink_gb_s: float  # per direction, per GPU

    def peak(self, math_kind: str) -> float:
        """FLOP/s of the unit a kernel's products run on (v4serve's kernels decode FP8/FP4 codes to
        bf16 and multiply there, so the FP8/FP4 rates are listed, not used)."""
        return {"bf16": self.bf16_tflops, "fp32": self.fp32_tflops}[math_kind] * 1e12


GPUS = (
    # NVIDIA H100 Tensor Core GPU datasheet, SXM column: 80 GB HBM3 at 3.35 TB/s; BF16 1,979 and FP8
    # 3,958 TFLOPS "with sparsity" (dense: half); FP32 67 TFLOPS; NVLink 900 GB/s (both directions
    # together); 132 SMs (the H100 SXM5's enabled SMs). No FP4 tensor cores on Hopper.
    Gpu("H100 SXM", 80, 3.35, 132, 989, 1979, None, 67, 450),
    # NVIDIA H200 datasheet (SXM): 141 GB HBM3e at 4.8 TB/s; the H100 SXM's compute, SMs and NVLink.
    Gpu("H200", 141, 4.8, 132, 989, 1979, None, 67, 450),
    # NVIDIA HGX B200 datasheet, 8 GPUs: 1,440 GB HBM3e, 64 TB/s; FP4 144, FP8 72, BF16 36 PFLOPS with
    # sparsity; FP32 600 TFLOPS; NVLink 5 at 1.8 TB/s per GPU. Per GPU, dense: 180 GB at 8 TB/s,
    # FP4 9, FP8 4.5, BF16 2.25 PFLOPS, FP32 75 TFLOPS; 148 SMs.
    Gpu("B200", 180, 8.0, 148, 2250, 4500, 9000, 75, 900),
)

# Achievable fractions and per-operation costs: assumptions, not measurements.
HBM_EFFICIENCY = 0.8  # a streaming kernel reaches ~80% of HBM bandwidth
FLOPS_EFFICIENCY = 0.65  # and ~65% of the tensor-core (or CUDA-core) peak
NVLINK_EFFICIENCY = 0.8  # of the per-direction NVLink bandwidth, for a large NCCL collective
# Host cost of one eager work item, not hidden by the GPU: published measurements put an ATen op's
# dispatch on CUDA at 3.3 us (PyTorch's operator micro-benchmarks, pytorch/pytorch#32194) and a
# Triton JIT launch at 8.7 us (vllm-project/vllm#34838, on a GB200 host); most items are ATen ops.
EAGER_ITEM_S = 5e-6
GRAPH_KERNEL_S = 1e-6  # one kernel inside a CUDA graph (allocations vanish: the graph's buffers are fixed); assumed
# One NCCL all-reduce (torch.distributed) on 8 H100s in one NVSwitch node, by payload: (bytes, seconds),
# measured (ByteDance-Seed/Triton-distributed#57, NCCL column; pytorch/helion#245 measured the same
# within 10%: 21.4 us at 8 KB, 24.7 at 256 KB, 55.8 at 1 MB). Interpolated linearly between the
# points, extended past the last at its slope.
NCCL_ALL_REDUCE_8 = ((128, 19.2e-6), (16 << 10, 20.7e-6), (64 << 10, 23.1e-6), (256 << 10, 24.8e-6),
                     (512 << 10, 25.2e-6), (1 << 20, 32.4e-6), (4 << 20, 59.4e-6), (8 << 20, 90.5e-6),
                     (16 << 20, 135.7e-6))
# Fewer ranks, less time: the ratio of 4- (2-) to 8-GPU all-reduce times measured side by side on
# H100 (sgl-project/sglang#2904, vLLM's column: 0.90, 0.73, 0.85, 0.89 at 512 B, 32 KB, 256 KB, 1 MB).
GROUP_SCALE = {2: 0.75, 4: 0.85, 8: 1.0}
# The engine's own host work per decode step (schedule, metadata, sampling bookkeeping, outputs, stats,
# IPC), measured with bench/bench_host.py on this project's 2-core CI machine (a GPU node's cores are
# faster: an upper bound): a fixed part and a part per sequence.
HOST_STEP_S = 0.2e-3
HOST_PER_SEQ_S = 18e-6


def nccl_all_reduce_s(nbytes: float, tp: int) -> float:
    """One all-reduce of `nbytes` across `tp` ranks (NCCL_ALL_REDUCE_8, scaled by GROUP_SCALE)."""
    points = NCCL_ALL_REDUCE_8
    if nbytes <= points[0][0]:
        t = points[0][1]
    else:
        lo, hi = points[-2], points[-1]
        for a, b in zip(points, points[1:], strict=False):
            if nbytes <= b[0]:
                lo, hi = a, b
                break
        t = lo[1] + (nbytes - lo[0]) * (hi[1] - lo[1]) / (hi[0] - lo[0])
    return t * GROUP_SCALE.get(tp, 1.0)


def host_step_s(batch: int) -> float:
    return HOST_STEP_S + HOST_PER_SEQ_S * batch
PROGRAM_BYTES_PER_S = 100e9  # what one program (one CTA on one SM) can stream from HBM or L2
# mHC's pre step (its two launches: the mixing split over K, then gates, Sinkhorn and the collapse) and
# its post step at 4096 channels and 4 streams, MEASURED on one H200 in the graphed decode step of
# bench/profile_decode.py (4 layers at V4's widths): 5.9 + 12.7 + 2.7 us a call at batch 1, 23.1 + 12.0
# + 3.5 us at batch 32. Their loops are latency-bound (~0.75 us a dependent trip), which neither bytes nor
# FLOPs capture: these are floors of the mHC time per call, interpolated in the batch.
MHC_CALL_S = ((1, 21.3e-6), (32, 38.6e-6))


def mhc_call_s(batch: int) -> float:
    """The measured floor at `batch` (held at batch 32's beyond it: past that, bytes and FLOPs govern)."""
    (b0, t0), (b1, t1) = MHC_CALL_S
    return t0 + (t1 - t0) * (min(max(batch, b0), b1) - b0) / (b1 - b0)

# Published peer figures (SGLang, H200, DeepSeek-V4-Flash, FP8 checkpoint; 8K in / 1K out). Their
# parallel layout (TP/DP/EP) and whether speculative decoding (MTP) was on are not stated with them.
PEER: dict[str, Any] = {"engine": "SGLang", "gpu": "H200", "model": "deepseek-v4-flash", "ttft_ms": 183.0,
                        "ms_per_token_concurrency_1": 3.26, "tok_s_per_gpu_high_throughput": 3975.0,
                        "workload": "8K in / 1K out", "prompt_tokens": 8192}

# ---------------------------------------------------------------------------------------------
# Weights per kernel and rank

KERNELS = ("mhc", "proj_x", "norm_rope", "proj_q", "cache_write", "indexer", "attention", "proj_out", "router",
           "moe_routed", "moe_shared", "all_reduce", "embed", "hc_head", "head", "logits_gather")
KERNEL_TEXT = {
    "mhc": "mHC pre/post x2 (+ sublayer norms)", "proj_x": "wq_a, wkv, compressors, index weights",
    "norm_rope": "q/kv norms, RoPE", "proj_q": "wq_b (+ indexer wq_b)", "cache_write": "window/compressor writes",
    "indexer": "index scores + top-k", "attention": "sparse attention", "proj_out": "wo_a, wo_b",
    "router": "gate (fp32) + route", "moe_routed": "routed experts (FP4)", "moe_shared": "shared expert (FP8)",
    "all_reduce": "all-reduces (TP)", "embed": "embedding + step setup", "hc_head": "mHC head + final norm",
    "head": "lm head (fp32)", "logits_gather": "logits all-gather (TP)",
}
_WEIGHT_KERNEL = (  # official name without `layers.{i}.` → the kernel that reads it
    (re.compile(r"^(?:hc_(?:attn|ffn)_(?:fn|base|scale)|(?:attn|ffn)_norm\.weight)$"), "mhc"),
    (re.compile(r"^attn\.(?:wq_a|wkv|(?:indexer\.)?compressor\.(?:wkv|wgate)|indexer\.weights_proj)\.weight$"),
     "proj_x"),
    (re.compile(r"^attn\.(?:q_norm|kv_norm)\.weight$"), "norm_rope"),
    (re.compile(r"^attn\.(?:indexer\.)?wq_b\.weight$"), "proj_q"),
    (re.compile(r"^attn\.(?:indexer\.)?compressor\.(?:ape|norm\.weight)$"), "cache_write"),
    (re.compile(r"^attn\.attn_sink$"), "attention"),
    (re.compile(r"^attn\.wo_[ab]\.weight$"), "proj_out"),
    (re.compile(r"^ffn\.gate\.(?:weight|bias|tid2eid)$"), "router"),
    (re.compile(r"^ffn\.experts\.\d+\.w[123]\.weight$"), "moe_routed"),
    (re.compile(r"^ffn\.shared_experts\.w[123]\.weight$"), "moe_shared"),
    (re.compile(r"^embed\.weight$"), "embed"),
    (re.compile(r"^head\.weight$"), "head"),
    (re.compile(r"^(?:norm\.weight|hc_head_(?:fn|base|scale))$"), "hc_head"),
)
_LAYER = re.compile(r"^layers\.(\d+)\.")
_ROUTER_TABLE = re.compile(r"\.gate\.(?:bias|tid2eid)$")  # hashed layers hold tid2eid, the others a bias


@dataclass
class Weights:
    """One rank's part of the weights one kernel reads."""

    bytes: int = 0  # resident, as the capacity plan counts them
    params: int = 0  # values (2 FLOPs each per token through a projection)
    rows: int = 0  # output features, summed (activation traffic)

    def add(self, nbytes: int, shape: tuple[int, ...]) -> None:
        self.bytes += nbytes
        self.params += math.prod(shape)
        self.rows += shape[0] if len(shape) >= 2 else 0


@dataclass
class ModelWeights:
    per_kind: dict[str, dict[str, Weights]]  # layer kind → kernel → weights (router table apart)
    router_table: dict[bool, Weights]  # hashed layer → tid2eid; score-routed → bias
    step: dict[str, Weights]  # embedding, head, mHC head and final norm

    def total(self, cfg: ModelConfig) -> int:
        layers = sum(sum(w.bytes for w in self.per_kind[cfg.layer_kind(i)].values())
                     + self.router_table[i < cfg.num_hash_layers].bytes for i in range(cfg.num_layers))
        return layers + sum(w.bytes for w in self.step.values())


def kernel_of_weight(template: str) -> str:
    for pattern, kernel in _WEIGHT_KERNEL:
        if pattern.search(template):
            return kernel
    raise ValueError(f"no kernel reads {template!r}: the model would leave its bytes out")


def rank_bytes(tensor: StoredTensor, tp: int) -> tuple[int, tuple[int, ...]]:
    """(resident bytes, shape) of rank 0's part of `tensor`: the plan's rules (its largest rank), no
    expert parallelism, weights kept in checkpoint precision where a kernel reads them packed."""
    shape = tensor.shape
    axis = tp_split_axis(tensor.name)
    if axis is not None and tp > 1:
        shape = (*shape[:axis], -(-shape[axis] // tp), *shape[axis + 1:])
    if tensor.is_int or (tensor.quant and can_stay_quantized(tensor.name)):
        return tensor.stored_bytes(shape), shape
    return math.prod(shape) * (4 if held_in_fp32(tensor.name) else ACT), shape


def model_weights(model: str, tp: int) -> ModelWeights:
    """Per layer kind from the reduced config (one window-only layer routed by hash, one CSA, one HCA):
    every layer of a kind holds the same tensors, except the router's table."""
    cfg = reduced_config(model)
    per_kind: dict[str, dict[str, Weights]] = {}
    tables: dict[int, Weights] = {}  # per layer
    step: dict[str, Weights] = {}
    for tensor in checkpoint_tensors(cfg):
        nbytes, shape = rank_bytes(tensor, tp)
        match = _LAYER.match(tensor.name)
        if match is None:
            step.setdefault(kernel_of_weight(tensor.name), Weights()).add(nbytes, shape)
            continue
        layer = int(match.group(1))
        if _ROUTER_TABLE.search(tensor.name):
            tables.setdefault(layer, Weights()).add(nbytes, shape)
            continue
        kernels = per_kind.setdefault(cfg.layer_kind(layer), {})
        kernels.setdefault(kernel_of_weight(tensor.name[match.end():]), Weights()).add(nbytes, shape)
    hashed = cfg.num_hash_layers  # layers 0 .. hashed-1 route by tid2eid, the next by score
    return ModelWeights(per_kind, {True: tables[0], False: tables[hashed]}, step)


# ---------------------------------------------------------------------------------------------
# Device work items per kernel: one decode step at the real shapes on the meta device

# Kernel-set entries whose every work item belongs to one modelled kernel; the others (`linear`,
# `rowwise`, ops outside any entry) belong to the kernel of the code that calls them (`_SECTION`).
_CALL_KERNEL = {"mhc_pre": "mhc", "mhc_post": "mhc", "rms_norm": "norm_rope", "rms_norm_rope": "norm_rope",
                "rope": "norm_rope", "round_keys": "norm_rope", "write_decode_step": "cache_write",
                "compress_decodes": "cache_write", "write_window": "cache_write", "index_scores": "indexer",
                "index_topk": "indexer", "sparse_attention": "attention", "grouped_linear": "proj_out",
                "route": "router", "experts": "moe_routed"}
_SECTION = {"setup": "embed", "embed": "embed", "block": "mhc", "attn": "attention", "proj_x": "proj_x",
            "proj_q": "proj_q", "cache_write": "cache_write", "indexer": "indexer", "router": "router",
            "moe_routed": "moe_routed", "moe_shared": "moe_shared", "all_reduce": "all_reduce",
            "hc_head": "hc_head", "head": "head", "logits_gather": "logits_gather"}
_COLLECTIVE_KERNEL = {"all_reduce": "all_reduce", "all_gather": "logits_gather"}


@dataclass
class Launches:
    """Device work items of one decode step: per (layer kind or "step", kernel), how many, how many
    of them are allocations (no launch on a GPU), and how many are collectives."""

    items: Counter[tuple[str, str]] = field(default_factory=Counter)
    allocations: Counter[tuple[str, str]] = field(default_factory=Counter)
    collectives: Counter[tuple[str, str]] = field(default_factory=Counter)

    def of(self, where: str, kernel: str) -> tuple[int, int]:
        """(work items, kernel launches) of one kernel of a layer kind or of the step."""
        items = self.items[where, kernel]
        return items, items - self.allocations[where, kernel]

    def total(self, where: str) -> int:
        return sum(n for (w, _), n in self.items.items() if w == where)

    def kernels(self, where: str) -> int:
        """Of `total`, those that launch a kernel on a GPU (not allocations)."""
        return self.total(where) - sum(n for (w, _), n in self.allocations.items() if w == where)

    def to_dict(self) -> dict[str, dict[str, list[int]]]:
        out: dict[str, dict[str, list[int]]] = {}
        for (where, kernel), n in sorted(self.items.items()):
            out.setdefault(where, {})[kernel] = [n, self.allocations[where, kernel], self.collectives[where, kernel]]
        return out

    @classmethod
    def from_dict(cls, raw: dict[str, dict[str, list[int]]]) -> Launches:
        out = cls()
        for where, kernels in raw.items():
            for kernel, (items, allocations, collectives) in kernels.items():
                out.items[where, kernel] = items
                out.allocations[where, kernel] = allocations
                out.collectives[where, kernel] = collectives
        return out


class _Tracker:
    """Where the forward is: the layer kind, the code section, the kernel-set entry being run."""

    def __init__(self) -> None:
        self.layer = "step"
        self.base = "setup"
        self.sections: list[str] = []
        self.calls: list[str] = []
        self.launches = Launches()

    def where(self) -> tuple[str, str]:
        call = self.calls[-1] if self.calls else None
        section = self.sections[-1] if self.sections else self.base
        if call in _CALL_KERNEL:
            return self.layer, _CALL_KERNEL[call]
        if section == "attn" and call == "linear":
            return self.layer, "proj_out"  # wo_b: the attention's only projection outside its two groups
        return self.layer, _SECTION[section]

    def count(self, allocation: bool) -> None:
        key = self.where()
        self.launches.items[key] += 1
        self.launches.allocations[key] += allocation

    def collective(self, kind: str) -> None:
        key = (self.layer, _COLLECTIVE_KERNEL[kind])
        self.launches.items[key] += 1  # one NCCL kernel
        self.launches.collectives[key] += 1

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        self.sections.append(name)
        try:
            yield
        finally:
            self.sections.pop()

    def in_section(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.section(name):
                return fn(*args, **kwargs)
        return run

    def in_call(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            try:
                return fn(*args, **kwargs)
            finally:
                self.calls.pop()
        return run


class _Counting(TorchDispatchMode):
    """LaunchCounter's rule (`launches.is_work`), each work item counted where it was made."""

    def __init__(self, tracker: _Tracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_work(func, out, args):
            self.tracker.count(str(func.overloadpacket) in ALLOCATIONS)
        return out


class _Recording(LaunchRecorder):
    """Triton launches are recorded, not run (the meta device has no data), and counted where made."""

    def __init__(self, tracker: _Tracker) -> None:
        super().__init__()
        self.tracker = tracker

    def record(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().record(kernel, grid, args, kwargs)
        self.tracker.count(False)


class _Collectives:
    """`torch.distributed` as parallel/sharding.py calls it, on the meta device: shapes only, calls counted."""

    def __init__(self, world_size: int, tracker: _Tracker) -> None:
        self.world_size, self.tracker = world_size, tracker

    def get_world_size(self) -> int:
        return self.world_size

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.tracker.collective("all_reduce")

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        self.tracker.collective("all_gather")  # the parts exist already; the meta device holds no values


def measure_launches(model: str, tp: int, context: int, kv_cache_dtype: str, batch: int = 2) -> Launches:
    """Work items of one decode step of `batch` sequences at `context` (the counts do not depend on
    the batch), per layer kind and kernel, rank 0 of `tp`, on the Triton kernels at the real shapes
    (meta device)."""
    tracker = _Tracker()
    net = meta_model(Scenario(model, kv_cache_dtype, tp, False))
    cfg = net.cfg
    kernels = net.layers[0].kernels
    traced = dataclasses.replace(kernels, **{f.name: tracker.in_call(f.name, getattr(kernels, f.name))
                                             for f in dataclasses.fields(kernels) if f.name != "backend"
                                             and callable(getattr(kernels, f.name))})
    for module in net.modules():
        if getattr(module, "kernels", None) is kernels:
            module.kernels = traced
        if getattr(module, "reduce", None) is not None:
            module.reduce = tracker.in_section("all_reduce", module.reduce)

    def enter(name: str) -> Callable[..., None]:
        return lambda *_: tracker.sections.append(name)

    def leave(*_: Any) -> None:
        tracker.sections.pop()

    for block in net.layers:
        def layer_in(module: Any, *_: Any) -> None:
            tracker.layer = module.attn.kind
            tracker.sections.append("block")

        def layer_out(module: Any, *_: Any) -> None:
            tracker.sections.pop()
            tracker.layer = "step"
            tracker.base = "head"  # what follows the last layer: the head (until _hc_head, gather_vocab)

        block.register_forward_pre_hook(layer_in)
        block.register_forward_hook(layer_out)
        for module, name in ((block.attn, "attn"), (block.ffn, "moe_routed"), (block.ffn.gate, "router"),
                             (block.ffn.shared_experts, "moe_shared")):
            if module is not None:
                module.register_forward_pre_hook(enter(name))
                module.register_forward_hook(leave)
        attn = block.attn
        attn.x_inputs = _Proxy(attn.x_inputs, tracker.in_section("proj_x", attn.x_inputs))
        attn.qr_inputs = _Proxy(attn.qr_inputs, tracker.in_section("proj_q", attn.qr_inputs))
        attn._compressions = tracker.in_section("cache_write", attn._compressions)
        if attn.indexer is not None:
            attn._select = tracker.in_section("indexer", attn._select)
            attn.indexer.queries = tracker.in_section("indexer", attn.indexer.queries)
    net._embed = tracker.in_section("embed", net._embed)
    net._hc_head = tracker.in_section("hc_head", net._hc_head)
    blocks = -(-(context + 1) // cfg.block_size)
    record = key_record(cfg.head_dim, cfg.rope_dim, "bfloat16", kv_cache_dtype)
    kv = DeviceKV(KVLayout.from_config(cfg, record), num_slots=batch, num_blocks=batch * blocks, dtype=torch.bfloat16,
                  device="meta")
    real_dist, real_gather = parallel_module.dist, model_module.gather_vocab
    parallel_module.dist = _Collectives(tp, tracker)  # type: ignore[assignment]
    model_module.gather_vocab = tracker.in_section("logits_gather", real_gather)
    try:
        with _Recording(tracker), _Counting(tracker):
            run_step(net, kv, Step("decode", decodes=(context,) * batch))
    finally:
        parallel_module.dist, model_module.gather_vocab = real_dist, real_gather
    return tracker.launches


class _Proxy:
    """A SharedInput whose call runs inside a section (the attention calls it like a function)."""

    def __init__(self, inner: Any, call: Callable[..., Any]) -> None:
        self._inner, self._call = inner, call

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._call(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


# Counts made by `measure_launches` at context 8K with bf16 KV, per TP: kernel → [work items, of which
# allocations, of which NCCL calls]. Both models give the same; TP > 1 adds the all-reduces (and their
# fp32 casts) and, per step, the embedding's shard mask and the logits' all-gather (one empty buffer
# per rank). `main` says when a fresh count differs. `--stored-launches` uses these.
STORED_LAUNCHES: dict[int, dict[str, dict[str, list[int]]]] = {
    1: {
        "csa": {"attention": [2, 1, 0], "cache_write": [5, 0, 0], "indexer": [8, 2, 0], "mhc": [12, 6, 0],
                "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [10, 5, 0], "proj_out": [4, 2, 0],
                "proj_q": [2, 1, 0], "proj_x": [3, 1, 0], "router": [5, 2, 0]},
        "hca": {"attention": [2, 1, 0], "cache_write": [3, 0, 0], "mhc": [12, 6, 0], "moe_routed": [10, 1, 0],
                "moe_shared": [10, 3, 0], "norm_rope": [8, 4, 0], "proj_out": [4, 2, 0], "proj_q": [2, 1, 0],
                "proj_x": [3, 1, 0], "router": [5, 2, 0]},
        "step": {"embed": [13, 0, 0], "hc_head": [14, 0, 0], "head": [10, 0, 0]},
        "swa": {"attention": [2, 1, 0], "cache_write": [1, 0, 0], "mhc": [12, 6, 0], "moe_routed": [10, 1, 0],
                "moe_shared": [10, 3, 0], "norm_rope": [8, 4, 0], "proj_out": [4, 2, 0], "proj_q": [2, 1, 0],
                "proj_x": [2, 1, 0], "router": [6, 2, 0]},
    },
    4: {
        "csa": {"all_reduce": [7, 0, 3], "attention": [2, 1, 0], "cache_write": [5, 0, 0], "indexer": [8, 2, 0],
                "mhc": [12, 6, 0], "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [10, 5, 0],
                "proj_out": [4, 2, 0], "proj_q": [2, 1, 0], "proj_x": [3, 1, 0], "router": [5, 2, 0]},
        "hca": {"all_reduce": [6, 0, 2], "attention": [2, 1, 0], "cache_write": [3, 0, 0], "mhc": [12, 6, 0],
                "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [8, 4, 0], "proj_out": [4, 2, 0],
                "proj_q": [2, 1, 0], "proj_x": [3, 1, 0], "router": [5, 2, 0]},
        "step": {"all_reduce": [1, 0, 1], "embed": [20, 0, 0], "hc_head": [14, 0, 0], "head": [10, 0, 0],
                "logits_gather": [6, 4, 1]},
        "swa": {"all_reduce": [6, 0, 2], "attention": [2, 1, 0], "cache_write": [1, 0, 0], "mhc": [12, 6, 0],
                "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [8, 4, 0], "proj_out": [4, 2, 0],
                "proj_q": [2, 1, 0], "proj_x": [2, 1, 0], "router": [6, 2, 0]},
    },
    8: {
        "csa": {"all_reduce": [7, 0, 3], "attention": [2, 1, 0], "cache_write": [5, 0, 0], "indexer": [8, 2, 0],
                "mhc": [12, 6, 0], "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [10, 5, 0],
                "proj_out": [4, 2, 0], "proj_q": [2, 1, 0], "proj_x": [3, 1, 0], "router": [5, 2, 0]},
        "hca": {"all_reduce": [6, 0, 2], "attention": [2, 1, 0], "cache_write": [3, 0, 0], "mhc": [12, 6, 0],
                "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [8, 4, 0], "proj_out": [4, 2, 0],
                "proj_q": [2, 1, 0], "proj_x": [3, 1, 0], "router": [5, 2, 0]},
        "step": {"all_reduce": [1, 0, 1], "embed": [20, 0, 0], "hc_head": [14, 0, 0], "head": [10, 0, 0],
                "logits_gather": [10, 8, 1]},
        "swa": {"all_reduce": [6, 0, 2], "attention": [2, 1, 0], "cache_write": [1, 0, 0], "mhc": [12, 6, 0],
                "moe_routed": [10, 1, 0], "moe_shared": [10, 3, 0], "norm_rope": [8, 4, 0], "proj_out": [4, 2, 0],
                "proj_q": [2, 1, 0], "proj_x": [2, 1, 0], "router": [6, 2, 0]},
    },
}


def launches_for(model: str, tp: int, context: int, kv_cache_dtype: str, stored: bool) -> Launches:
    if stored:
        # FP8 keys add the key rounding; contexts under 4 x index_topk, the top-k's padded path.
        if (context, kv_cache_dtype) != (CONTEXT, "auto") or tp not in STORED_LAUNCHES:
            raise ValueError(f"work items are stored for context {CONTEXT}, bf16 KV and TP {sorted(STORED_LAUNCHES)} "
                             "only: count them (without --stored-launches)")
        return Launches.from_dict(STORED_LAUNCHES[tp])
    return measure_launches(model, tp, context, kv_cache_dtype)


# ---------------------------------------------------------------------------------------------
# Bytes, FLOPs and launches of each kernel


@dataclass
class Work:
    """One kernel of one layer (or of the step), on one rank, `count` times per step."""

    kernel: str
    count: int = 1
    bytes: float = 0.0  # HBM traffic: weights, activations, KV
    weight_bytes: float = 0.0  # of which weights (each read once)
    flops: float = 0.0
    math: str = "bf16"  # the unit its products run on: "bf16" tensor cores or "fp32" CUDA cores
    program_bytes: float = 0.0  # what one program of its grid must move (the grid-limited kernels)
    program_flops: float = 0.0  # and compute
    measured_s: float = 0.0  # a floor measured on a GPU (latency-bound loops), per count
    items: int = 0  # eager work items (ATen ops, Triton launches, NCCL calls)
    launches: int = 0  # of which launch a kernel (what a CUDA graph replays)
    all_reduce_calls: int = 0
    all_reduce_bytes: float = 0.0  # payload of all of them
    all_gather_calls: int = 0
    all_gather_bytes: float = 0.0  # the gathered output


@dataclass(frozen=True)
class Times:
    """Seconds of one Work on one GPU, all of its `count` together."""

    memory: float
    compute: float
    program: float
    measured: float
    comm: float
    eager_overhead: float
    graph_overhead: float

    @property
    def device(self) -> float:
        return max(self.memory, self.compute, self.program, self.measured) + self.comm

    @property
    def eager(self) -> float:
        return self.device + self.eager_overhead

    @property
    def graphs(self) -> float:
        return self.device + self.graph_overhead


def work_times(work: Work, gpu: Gpu, tp: int) -> Times:
    n = work.count
    ring = (tp - 1) / tp
    link = gpu.nvlink_gb_s * 1e9 * NVLINK_EFFICIENCY
    comm = ring * work.all_gather_bytes / link + work.all_gather_calls * nccl_all_reduce_s(0, tp)
    if work.all_reduce_calls:
        comm += work.all_reduce_calls * nccl_all_reduce_s(work.all_reduce_bytes / work.all_reduce_calls, tp)
    per_sm = gpu.peak(work.math) / gpu.sms * FLOPS_EFFICIENCY
    return Times(memory=n * work.bytes / (gpu.hbm_tb_s * 1e12 * HBM_EFFICIENCY),
                 compute=n * work.flops / (gpu.peak(work.math) * FLOPS_EFFICIENCY),
                 program=n * max(work.program_bytes / PROGRAM_BYTES_PER_S, work.program_flops / per_sm),
                 measured=n * work.measured_s,
                 comm=n * comm if tp > 1 else 0.0,
                 eager_overhead=n * work.items * EAGER_ITEM_S, graph_overhead=n * work.launches * GRAPH_KERNEL_S)


def experts_touched(experts: int, topk: int, tokens: int) -> float:
    """Expected distinct experts that `tokens` tokens choose, each picking `topk` of `experts` (as if
    uniformly: the router's balance target)."""
    return experts * (1 - (1 - topk / experts) ** tokens)


@dataclass(frozen=True)
class Case:
    model: str
    tp: int
    batch: int
    context: int
    kv_cache_dtype: str


def step_work(case: Case, weights: ModelWeights, launches: Launches) -> list[Work]:
    """Every kernel of one decode step of `case` on one rank (rank 0: the largest shard)."""
    cfg = preset_config(case.model)
    b, n_tp = case.batch, case.tp
    d, hc = cfg.hidden_size, cfg.hc_mult
    layout = KVLayout.from_config(cfg, key_record(cfg.head_dim, cfg.rope_dim, "bfloat16", case.kv_cache_dtype))
    works: list[Work] = []
    groups = Counter((cfg.layer_kind(i), i < cfg.num_hash_layers) for i in range(cfg.num_layers))
    for (kind, hashed), count in sorted(groups.items()):
        layer = next(lay for lay in layout.layers if lay.kind == kind)
        for work in _layer_work(cfg, kind, layer, weights.per_kind[kind], weights.router_table[hashed], hashed, case):
            work.count = count
            work.items, work.launches = launches.of(kind, work.kernel)
            _check_collectives(work, launches.collectives[kind, work.kernel], kind)
            works.append(work)
    # Per step: the embedding (with the step's setup: rotary tables, metadata), mHC head, lm head.
    vocab_rows = -(-cfg.vocab_size // n_tp)
    step = weights.step
    per_step = [
        Work("embed", bytes=b * d * ACT * (1 + hc + (2 if n_tp > 1 else 0)), weight_bytes=b * d * ACT),
        Work("hc_head", bytes=step["hc_head"].bytes + b * hc * d * (ACT + 4 + 4) + b * d * (4 + ACT),
             weight_bytes=step["hc_head"].bytes, flops=2 * b * hc * hc * d, math="fp32"),
        # The head is held in fp32 (resident.held_in_fp32): read once by an fp32 GEMM, never cast.
        Work("head", bytes=step["head"].bytes + b * d * (ACT + 4) + b * vocab_rows * 4,
             weight_bytes=step["head"].bytes, flops=2 * b * step["head"].params, math="fp32"),
    ]
    if n_tp > 1:
        per_step += [Work("all_reduce", all_reduce_calls=1, all_reduce_bytes=b * d * ACT),  # the embedding's
                     # Each rank's [B, V/N] fp32 logits gathered, then concatenated into [B, V].
                     Work("logits_gather", bytes=2 * b * n_tp * vocab_rows * 4, all_gather_calls=1,
                          all_gather_bytes=b * n_tp * vocab_rows * 4)]
    for work in per_step:
        work.items, work.launches = launches.of("step", work.kernel)
        _check_collectives(work, launches.collectives["step", work.kernel], "step")
    return works + per_step


def _check_collectives(work: Work, made: int, where: str) -> None:
    """The collectives modelled are those the forward made (measured, or stored from a measurement)."""
    modelled = work.all_reduce_calls + work.all_gather_calls
    if modelled != made:
        raise ValueError(f"{where} {work.kernel}: {modelled} collectives modelled, the forward made {made}")


def _layer_work(cfg: ModelConfig, kind: str, layer: LayerLayout, w: dict[str, Weights], table: Weights, hashed: bool,
                case: Case) -> list[Work]:
    """One layer's kernels of `kind`; its router's table is `table` (tid2eid when `hashed`, else the bias)."""
    b, ctx, n_tp = case.batch, case.context, case.tp
    d, hd, hc, q = cfg.hidden_size, cfg.head_dim, cfg.hc_mult, cfg.q_lora_rank
    mix = (2 + hc) * hc
    heads, index_heads = cfg.num_heads // n_tp, cfg.index_n_heads // n_tp
    idim, topk, experts, k = cfg.index_head_dim, cfg.index_topk, cfg.n_routed_experts, cfg.num_experts_per_tok
    key_bytes = layer.key_width * (1 if layer.record else ACT)
    seen = ctx + 1  # positions the decoded token sees, itself included
    window = min(cfg.window, seen)
    entries = seen // layer.ratio if layer.ratio else 0
    keys = window + (min(topk, entries) if kind == "csa" else entries)
    csa = kind == "csa"

    def gemm(name: str, inputs: int) -> Work:
        ws = w[name]
        return Work(name, bytes=ws.bytes + b * (inputs + ws.rows) * ACT, weight_bytes=ws.bytes, flops=2 * b * ws.params)

    # mHC, twice (attention and MoE): `mhc_pre`'s mixing is split over 64 slices of hc_fn ([mix, hc·d],
    # fp32) in programs of 2 tokens, then one program per 2 tokens adds the slices, runs Sinkhorn and
    # collapses the streams; `mhc_post` mixes them back. Floored by the H200's measured time a call.
    mhc = Work("mhc", bytes=w["mhc"].bytes + 2 * b * (3 * hc * d + 2 * d) * ACT, weight_bytes=w["mhc"].bytes,
               flops=2 * 2 * b * mix * hc * d, math="fp32", measured_s=2 * mhc_call_s(b))
    works = [mhc, gemm("proj_x", d)]
    norm = Work("norm_rope", bytes=w["norm_rope"].bytes + 2 * b * ACT * (q + 2 * heads * hd + hd
                                                                          + (index_heads * idim if csa else 0)),
                weight_bytes=w["norm_rope"].bytes)
    works += [norm, gemm("proj_q", q)]
    # Cache writes of one decode step: the window row, one row of each compressor ring, and (once
    # every `ratio` steps, so 1/ratio of it per step) the ring read back and pooled into an entry.
    per_seq = key_bytes
    if layer.ratio:
        shapes = layer.slot_shapes()
        pending = sum(math.prod(s) for name, s in shapes.items() if name != "window") * ACT
        entry = layer.block_bytes(ACT) / layer.entries_per_block
        per_seq += pending / layer.pending_rows + (pending + entry) / layer.ratio
    works.append(Work("cache_write", bytes=w.get("cache_write", Weights()).bytes + b * per_seq,
                      weight_bytes=w.get("cache_write", Weights()).bytes))
    if csa:
        # Scores of every visible entry from the bf16 index keys (fp32 queries and head weights), written,
        # all-reduced, read by the top-k, which writes k int64 indices.
        works.append(Work("indexer", bytes=b * entries * idim * ACT + b * index_heads * (idim + 1) * 4
                          + 2 * b * entries * 4 + b * topk * 8,
                          flops=2 * b * index_heads * idim * entries))
    # Attention: a program per token and 16 heads reads all of the token's keys (no split over keys),
    # so a token's keys are read once per 16 of this rank's heads (no L2 reuse assumed).
    head_blocks = -(-heads // 16)
    works.append(Work("attention", bytes=w["attention"].bytes + b * keys * key_bytes * head_blocks
                      + 2 * b * heads * hd * ACT + (b * topk * 8 if csa else 0),
                      weight_bytes=w["attention"].bytes, flops=4 * b * heads * keys * hd,
                      program_bytes=keys * key_bytes + 2 * 16 * hd * ACT,
                      program_flops=4 * min(16, heads) * keys * hd))
    works.append(gemm("proj_out", heads * hd + (cfg.o_groups // n_tp) * cfg.o_lora_rank))
    # Router in fp32 (its weight and bias held so: resident.held_in_fp32), an fp32 GEMM on CUDA cores.
    gate = w["router"]
    table_read = b * k * 8 if hashed else table.bytes  # tid2eid rows gathered, or the bias
    works.append(Work("router", bytes=gate.bytes + table_read + b * d * (ACT + 4) + 2 * b * experts * 4
                      + b * (k + 1) * 12, weight_bytes=gate.bytes + (b * k * 8 if hashed else table.bytes),
                      flops=2 * b * gate.params, math="fp32"))
    # Routed experts: the touched ones' slices; each (token, expert) pair's activations.
    routed = w["moe_routed"]
    per_expert, inter = routed.bytes / experts, cfg.moe_intermediate_size // n_tp
    per_value = per_expert / (3 * d * inter)
    block_n = max(16, min(1 << (inter - 1).bit_length(), 64))  # moe_triton's up-kernel column tile
    touched = experts_touched(experts, k, b)
    works.append(Work("moe_routed", bytes=touched * per_expert + b * k * (2 * d + 3 * inter) * ACT + b * k * 8 * 4,
                      weight_bytes=touched * per_expert, flops=2 * b * k * routed.params / experts,
                      program_bytes=(2 * block_n * d + 64 * inter) * per_value))
    # Shared expert: three packed GEMMs and a SwiGLU (x in; gate and up out, into SwiGLU, its output
    # into w2; w2's output).
    shared, shared_width = w["moe_shared"], cfg.shared_intermediate_size // n_tp
    works.append(Work("moe_shared", bytes=shared.bytes + b * (2 * d + 6 * shared_width) * ACT,
                      weight_bytes=shared.bytes, flops=2 * b * shared.params))
    if n_tp > 1:
        # Attention and MoE outputs (bf16 → fp32, all-reduced, back), and a CSA layer's index scores.
        works.append(Work("all_reduce", bytes=2 * b * d * (ACT + 4) * 2, all_reduce_calls=2 + csa,
                          all_reduce_bytes=2 * b * d * 4 + (b * entries * 4 if csa else 0)))
    return works


# ---------------------------------------------------------------------------------------------
# Cases


def fit_plan(model: str, tp: int, context: int, kv_cache_dtype: str) -> CapacityPlan:
    """The capacity plan at `context` + 1 tokens per sequence (the memory is set per GPU: `on_gpu`)."""
    return plan_model(model, PlanSettings(memory_bytes=GIB, tensor_parallel_size=tp, kv_cache_dtype=kv_cache_dtype,
                                          max_model_len=context + 1))


def on_gpu(plan: CapacityPlan, gpu: Gpu) -> CapacityPlan:
    return dataclasses.replace(plan, settings=dataclasses.replace(plan.settings,
                                                                  memory_bytes=int(gpu.memory_gib * GIB)))


def evaluate(case: Case, gpu: Gpu, works: list[Work]) -> dict[str, Any]:
    """Per kernel (summed over layers) and per step, eager and graphs."""
    kernels: dict[str, dict[str, float]] = {}
    for work in works:
        t = work_times(work, gpu, case.tp)
        row = kernels.setdefault(work.kernel, dict.fromkeys(
            ("bytes", "weight_bytes", "flops", "items", "launches", "memory_s", "compute_s", "program_s", "measured_s",
             "comm_s", "device_s", "eager_s", "graphs_s"), 0.0))
        for key, value in (("bytes", work.bytes), ("weight_bytes", work.weight_bytes), ("flops", work.flops),
                           ("items", work.items), ("launches", work.launches)):
            row[key] += work.count * value
        for key, value in (("memory_s", t.memory), ("compute_s", t.compute), ("program_s", t.program),
                           ("measured_s", t.measured), ("comm_s", t.comm), ("device_s", t.device),
                           ("eager_s", t.eager), ("graphs_s", t.graphs)):
            row[key] += value
    out: dict[str, Any] = {"kernels": {k: kernels[k] for k in KERNELS if k in kernels}}
    for mode in ("eager", "graphs"):
        step_s = sum(row[f"{mode}_s"] for row in kernels.values())
        bound = max(kernels, key=lambda k: kernels[k][f"{mode}_s"])
        out[mode] = {"step_s": step_s, "tok_s_per_gpu": case.batch / step_s / case.tp, "bound": bound,
                     "bound_share": kernels[bound][f"{mode}_s"] / step_s}
    # Eager as above adds the host's cost of every work item to the device's time, as if the GPU
    # waited for each launch: right when kernels are shorter than their launches (small batches), an
    # overestimate when the host runs ahead. The other end: the host's time fully hidden behind the
    # device's (which still pays the GPU-side gap of each kernel, as in a graph), or the reverse.
    host_s = sum(row["items"] for row in kernels.values()) * EAGER_ITEM_S
    out["eager"]["overlapped_step_s"] = max(host_s, out["graphs"]["step_s"])
    out["v4serve"] = as_run(case, out)
    for key in ("bytes", "weight_bytes", "flops", "items", "launches", "memory_s", "compute_s", "program_s",
                "measured_s", "comm_s", "device_s"):
        out[key] = sum(row[key] for row in kernels.values())
    return out


def as_run(case: Case, out: dict[str, Any]) -> dict[str, Any]:
    """The step as v4serve runs it, the engine's host work included: CUDA graphs (on every rank under
    tensor parallelism) with async scheduling, the host's step hidden behind the device's or the
    reverse."""
    host = host_step_s(case.batch)
    step, mode = max(out["graphs"]["step_s"], host), "CUDA graphs, async scheduling"
    return {"step_s": step, "tok_s_per_gpu": case.batch / step / case.tp, "mode": mode, "host_s": host}


def predict(models: list[str], gpus: list[Gpu], tps: list[int], batches: list[int], context: int,
            kv_cache_dtype: str, stored_launches: bool) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    cases: list[dict[str, Any]] = []
    launch_info: dict[str, Any] = {}
    for model in models:
        cfg = preset_config(model)
        for tp in tps:
            plan = fit_plan(model, tp, context, kv_cache_dtype)
            weights = model_weights(model, tp)
            if weights.total(cfg) != plan.weights_per_rank.total:  # every tensor read by some kernel, once
                raise ValueError(f"{model} TP {tp}: kernels hold {weights.total(cfg)} bytes, the plan "
                                 f"{plan.weights_per_rank.total}")
            launches = launches_for(model, tp, context, kv_cache_dtype, stored_launches)
            launch_info[f"{model} TP {tp}"] = launches.to_dict()
            for gpu in gpus:
                fitted = on_gpu(plan, gpu)
                for batch in batches:
                    case = Case(model, tp, batch, context, kv_cache_dtype)
                    row: dict[str, Any] = {**dataclasses.asdict(case), "gpu": gpu.name, "fits": fitted.fits,
                                           "max_concurrent_sequences": fitted.max_concurrent_sequences,
                                           "weights_per_rank_bytes": plan.weights_per_rank.total}
                    if fitted.fits:
                        row.update(evaluate(case, gpu, step_work(case, weights, launches)))
                    cases.append(row)
    return cases, launch_info


# ---------------------------------------------------------------------------------------------
# Beside the peer figures


def compare_with_peer(cases: list[dict[str, Any]], context: int) -> list[dict[str, Any]]:
    """The published SGLang figures (H200, V4-Flash) against the predictions at each TP that fits."""
    rows: list[dict[str, Any]] = []

    def row(figure: str, tp: int, mode: str, predicted: float, peer: float) -> None:
        if mode == "v4serve":
            mode = next(c["v4serve"]["mode"] for c in ours if c["tp"] == tp)
        rows.append({"figure": figure, "tp": tp, "mode": mode, "predicted": predicted, "peer": peer,
                     "ratio": predicted / peer})

    ours = [c for c in cases if c["gpu"] == PEER["gpu"] and c["model"] == PEER["model"] and c["fits"]]
    largest = max((c["batch"] for c in ours), default=0)
    for case in ours:
        for mode in ("v4serve",):
            if case["batch"] == 1:
                row(f"ms per token, concurrency 1 (ours: batch 1, context {context})", case["tp"], mode,
                    case[mode]["step_s"] * 1e3, PEER["ms_per_token_concurrency_1"])
            if case["batch"] == largest:
                row(f"tokens/s per GPU, high throughput (ours: batch {largest}, context {context})", case["tp"], mode,
                    case[mode]["tok_s_per_gpu"], PEER["tok_s_per_gpu_high_throughput"])
    gpu = next(g for g in GPUS if g.name == PEER["gpu"])
    prompt = int(PEER["prompt_tokens"])
    for tp in sorted({c["tp"] for c in ours}):
        row(f"TTFT: prefill compute floor of {prompt} tokens (not a decode prediction)", tp, "-",
            prefill_floor_s(PEER["model"], tp, prompt, gpu) * 1e3, PEER["ttft_ms"])
    return rows


def prefill_floor_s(model: str, tp: int, tokens: int, gpu: Gpu) -> float:
    """A lower bound on a prompt's prefill: its FLOPs (every active weight per token, and the
    attention's and indexer's dot products at the average context) at the achievable bf16 peak, no
    launch, memory or collective time."""
    cfg, weights = preset_config(model), model_weights(model, tp)
    per_token = 0.0
    for i in range(cfg.num_layers):
        kind = cfg.layer_kind(i)
        w = weights.per_kind[kind]
        active = sum(w[k].params for k in ("proj_x", "proj_q", "proj_out", "moe_shared", "router"))
        active += w["moe_routed"].params * cfg.num_experts_per_tok / cfg.n_routed_experts
        seen = tokens / 2  # average context over the prompt
        ratio = cfg.compress_ratios[i]
        keys = min(cfg.window, seen) + (min(cfg.index_topk, seen / ratio) if kind == "csa" else
                                        seen / ratio if ratio else 0)
        attention = 4 * (cfg.num_heads // tp) * keys * cfg.head_dim
        index = 2 * (cfg.index_n_heads // tp) * cfg.index_head_dim * seen / ratio if kind == "csa" else 0
        per_token += 2 * active + attention + index
    return tokens * per_token / (gpu.peak("bf16") * FLOPS_EFFICIENCY)


# ---------------------------------------------------------------------------------------------
# Output


def _ms(seconds: float) -> float:
    return seconds * 1e3


def print_tables(cases: list[dict[str, Any]], launch_info: dict[str, Any], comparison: list[dict[str, Any]],
                 context: int, kv_cache_dtype: str, launch_source: str) -> None:
    kv = "FP8 keys (584 B)" if kv_cache_dtype == "fp8" else "bf16 keys (1024 B)"
    print(f"PREDICTED, NOT MEASURED: a model on paper of v4serve's decode step (Triton kernels), context {context} "
          f"tokens, {kv}.")
    print(f"Assumptions: {HBM_EFFICIENCY:.0%} of HBM bandwidth, {FLOPS_EFFICIENCY:.0%} of peak FLOPs (bf16 tensor "
          f"cores: the kernels decode FP8/FP4 codes to bf16, so the FP8/FP4 rates go unused; fp32 CUDA cores for the "
          f"router, mHC and lm head), {NVLINK_EFFICIENCY:.0%} of NVLink per direction "
          f"for the logits' all-gather, NCCL all-reduces as measured on 8 H100s (19-136 us by size; x"
          f"{GROUP_SCALE[4]} at 4 ranks), {EAGER_ITEM_S * 1e6:.0f} us per eager work item, "
          f"{GRAPH_KERNEL_S * 1e6:.0f} us per kernel in a CUDA graph, {PROGRAM_BYTES_PER_S / 1e9:.0f} GB/s for one "
          f"program; overheads add to device time (no overlap); the engine's host work {HOST_STEP_S * 1e3:.1f} ms "
          f"+ {HOST_PER_SEQ_S * 1e6:.0f} us per sequence per step (bench/bench_host.py). Work items: {launch_source}.")
    print_table("Hardware (datasheets; dense)", ["GPU", "memory GiB", "HBM TB/s", "SMs", "BF16 TF", "FP8 TF", "FP4 TF",
                                                 "FP32 TF", "NVLink GB/s/dir"],
                [[g.name, g.memory_gib, g.hbm_tb_s, g.sms, g.bf16_tflops, g.fp8_tflops, g.fp4_tflops or "-",
                  g.fp32_tflops, g.nvlink_gb_s] for g in GPUS])
    rows = []
    for name, raw in launch_info.items():
        launches = Launches.from_dict(raw)
        rows.append([name, *(f"{launches.total(k)} ({launches.kernels(k)})" for k in ("swa", "csa", "hca", "step"))])
    print_table("Device work items of one decode step (kernel launches in brackets: the rest are allocations); "
                "NCCL calls included", ["model, TP", "SWA layer", "CSA layer", "HCA layer", "per step"], rows)
    # One case per model in detail: H200 at the smallest TP that fits, every batch.
    for model in dict.fromkeys(c["model"] for c in cases):
        fitting = [c for c in cases if c["model"] == model and c["gpu"] == "H200" and c["fits"]]
        if not fitting:
            continue
        tp = min(c["tp"] for c in fitting)
        detail = sorted((c for c in fitting if c["tp"] == tp), key=lambda c: c["batch"])
        header = ["kernel", "what", "items/step"] + [f"B={c['batch']} {m}" for c in detail
                                                     for m in ("graphs us", "eager us")]
        body = []
        for kernel in detail[0]["kernels"]:
            row: list[Any] = [kernel, KERNEL_TEXT[kernel], int(detail[0]["kernels"][kernel]["items"])]
            for c in detail:
                k = c["kernels"][kernel]
                row += [round(k["graphs_s"] * 1e6), round(k["eager_s"] * 1e6)]
            body.append(row)
        body.append(["step", "", int(detail[0]["items"])] + [round(c[m]["step_s"] * 1e6) for c in detail
                                                             for m in ("graphs", "eager")])
        print_table(f"{model} on H200, TP {tp}: each kernel summed over the step's layers (predicted)", header, body)
    body = []
    for c in cases:
        head = [c["model"].removeprefix("deepseek-v4-"), c["gpu"], c["tp"], c["batch"],
                f"{c['weights_per_rank_bytes'] / GIB:.1f}"]
        if not c["fits"]:
            body.append(head + ["does not fit"] + ["-"] * 8)
            continue
        seqs, run = c["max_concurrent_sequences"], c["v4serve"]
        body.append(head + [f"{seqs}" + ("!" if seqs < c["batch"] else ""), f"{c['bytes'] / 1e9:.2f}",
                            _ms(c["eager"]["step_s"]), _ms(c["graphs"]["step_s"]),
                            _ms(run["host_s"]), _ms(run["step_s"]), round(run["tok_s_per_gpu"]), run["mode"],
                            f"{c['eager']['bound']} {c['eager']['bound_share']:.0%}"])
    print_table("Decode step per case (predicted; max seqs: the capacity plan's sequences at this context, "
                "! = fewer than the batch; v4serve: as the code runs it, the engine's host "
                "work included)",
                ["model", "GPU", "TP", "batch", "weights GiB/rank", "max seqs", "GB read/rank", "eager ms",
                 "graphs ms", "host ms", "v4serve ms", "v4serve tok/s/GPU", "how", "bound (eager)"],
                body)
    print_table(f"Beside the published peer figures ({PEER['engine']}, {PEER['gpu']}, V4-Flash, FP8 checkpoint, "
                f"{PEER['workload']}); ratio = predicted / peer",
                ["figure", "TP", "mode", "predicted", "peer", "ratio"],
                [[r["figure"], r["tp"], r["mode"], _figure(r["predicted"]), _figure(r["peer"]), r["ratio"]]
                 for r in comparison])


def _figure(value: float) -> str:
    return f"{value:,.0f}" if value >= 100 else f"{value:.3g}"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--gpus", default=",".join(g.name for g in GPUS))
    parser.add_argument("--tp", default=",".join(map(str, TPS)))
    parser.add_argument("--batches", default=",".join(map(str, BATCHES)))
    parser.add_argument("--context", type=int, default=CONTEXT, help="tokens before the decoded one")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--stored-launches", action="store_true",
                        help="the work-item counts stored in this file instead of counting a meta-device step")
    parser.add_argument("--results-name", default="gpu_model", help="bench/results/<name>.json")
    args = parser.parse_args(argv)
    gpus = [g for name in args.gpus.split(",") for g in GPUS if g.name == name]
    models = args.models.split(",")
    tps, batches = [int(x) for x in args.tp.split(",")], [int(x) for x in args.batches.split(",")]
    cases, launch_info = predict(models, gpus, tps, batches, args.context, args.kv_cache_dtype, args.stored_launches)
    source = "stored counts (STORED_LAUNCHES)" if args.stored_launches else "counted now on the meta device"
    if not args.stored_launches:
        stale = [name for name, raw in launch_info.items()
                 if raw != STORED_LAUNCHES.get(int(name.rsplit(" ", 1)[1]), raw)]
        if args.context == CONTEXT and args.kv_cache_dtype == "auto" and stale:
            source += f" (they differ from STORED_LAUNCHES for {', '.join(stale)}: update it)"
    comparison = compare_with_peer(cases, args.context)
    print_tables(cases, launch_info, comparison, args.context, args.kv_cache_dtype, source)
    payload = {
        "note": "PREDICTED, NOT MEASURED: a step-time model on paper (bench/gpu_model.py)",
        "assumptions": {"hbm_efficiency": HBM_EFFICIENCY, "flops_efficiency": FLOPS_EFFICIENCY,
                        "nvlink_efficiency": NVLINK_EFFICIENCY, "nccl_all_reduce_8": NCCL_ALL_REDUCE_8,
                        "group_scale": GROUP_SCALE, "host_step_s": HOST_STEP_S, "host_per_seq_s": HOST_PER_SEQ_S,
                        "eager_item_s": EAGER_ITEM_S, "graph_kernel_s": GRAPH_KERNEL_S,
                        "program_bytes_per_s": PROGRAM_BYTES_PER_S, "context": args.context,
                        "kv_cache_dtype": args.kv_cache_dtype, "launches": source},
        "gpus": [dataclasses.asdict(g) for g in gpus], "peer": PEER, "launches": launch_info,
        "cases": cases, "comparison": comparison,
    }
    write_results(args.results_name, payload)
    return payload


if __name__ == "__main__":
    main()
