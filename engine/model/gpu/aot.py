"""Which Triton specializations the model launches at the real shapes of DeepSeek-V4-Flash and -Pro,
recorded without running anything: the model is built on the `meta` device (no memory, no data) at
a preset's widths, packed as the published checkpoints are (FP4 routed experts, FP8 attention and
shared experts, e8m0 scales), and steps run under `kernels.launches.LaunchRecorder`, which records
each launch instead of making it. `kernels/aot.py` then compiles them for real GPU targets.

A step on the meta device also proves it never reads the device from the host: a meta tensor has
no values, so any op whose result depends on them (`.item()`, `nonzero`, `bincount`, ...) fails.

One layer of each kind is enough (every layer of a kind launches the same specializations): a
window-only layer routed by token hash, then a CSA and an HCA layer routed by score. Under tensor
parallelism a rank's shard is built and the collectives keep only their shapes (each rank's
kernels see its own heads, groups and experts).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from v4serve.cache.device_kv import DeviceKV
from v4serve.cache.layout import KVLayout, key_record
from v4serve.engine.model.config import ModelConfig
from v4serve.engine.model.metadata import AttentionMetadata, SeqChunk
from v4serve.engine.model.parallel import sharding as parallel_module
from v4serve.engine.model.parallel.sharding import ParallelConfig
from v4serve.engine.model.plan import checkpoint_tensors, preset_config
from v4serve.engine.model.v4.model import DeepseekV4
from v4serve.engine.model.weights.packed import PackedFormat, pack_model
from v4serve.engine.model.weights.resident import can_stay_quantized
from v4serve.kernels.attention import RowLayout
from v4serve.kernels.launches import Launch, LaunchRecorder
from v4serve.kernels.registry import load_kernels

LAYER_KINDS = (0, 4, 128)  # window-only (hash-routed), CSA, HCA


@dataclass(frozen=True)
class Step:
    """One engine step's shape: the contexts of its decoding sequences and its prefill chunks
    (start, tokens)."""

    name: str
    decodes: tuple[int, ...] = ()
    chunks: tuple[tuple[int, int], ...] = ()
    table_width: int | None = None  # block tables padded to this many blocks, as a captured decode step's are
    rows: int = 0  # the chunks run row-wise, at most this many rows each (a drafted pass: `RowWrites`)


@dataclass(frozen=True)
class Scenario:
    model: str  # a preset: deepseek-v4-flash, deepseek-v4-pro
    kv_cache_dtype: str = "auto"  # auto (bf16 keys) or fp8
    tensor_parallel_size: int = 1
    expert_parallel: bool = False

    @property
    def name(self) -> str:
        kv = "fp8 KV" if self.kv_cache_dtype == "fp8" else "bf16 KV"
        split = f"TP {self.tensor_parallel_size}" + (" EP" if self.expert_parallel else "")
        return f"{self.model.removeprefix('deepseek-v4-')} {split} {kv}"


DECODE_STEPS = (
    Step("decode b1 @300", decodes=(300,)),
    Step("decode b1 @8K", decodes=(8192,)),
    Step("decode b8 @8K", decodes=(8192,) * 8),
    Step("decode b32 @300", decodes=(300,) * 32),
    Step("decode b1 @64K", decodes=(65536,)),
    Step("decode b64 @8K", decodes=(8192,) * 64),
    Step("decode b256 @1K", decodes=(1024,) * 256),
    # A captured step's tables are as wide as --max-model-len allows (64K tokens: 512 blocks).
    Step("decode b128 @4K, tables padded to 64K", decodes=(4096,) * 128, table_width=512),
    # A drafted pass (MTP: the last token and one draft per sequence), row-wise as a captured one runs.
    Step("drafted b64 @8K, 2 rows, tables padded to 64K", chunks=((8192, 2),) * 64, table_width=512, rows=2),
)
PREFILL_STEPS = (
    Step("chunk 32 @0", chunks=((0, 32),)),
    Step("chunk 512 @4K", chunks=((4096, 512),)),
    Step("mixed: chunk 32 @4K + 4 decodes @8K", decodes=(8192,) * 4, chunks=((4096, 32),)),
)


SCENARIOS = tuple(Scenario(model, kv, tp, ep) for model in ("deepseek-v4-flash", "deepseek-v4-pro")
                  for kv in ("auto", "fp8") for tp, ep in ((1, False), (8, False), (8, True)))


@dataclass
class Recorded:
    """Launches recorded over scenarios: each specialization with where it was seen."""

    scenarios: dict[Launch, set[str]] = dataclasses.field(default_factory=dict)
    in_decode: set[Launch] = dataclasses.field(default_factory=set)  # launched by a decode-only step

    @property
    def decode_kernels(self) -> set[str]:
        return {launch.name for launch in self.in_decode}


def record_scenarios(scenarios: Sequence[Scenario], decode: Sequence[Step] = DECODE_STEPS,
                     prefill: Sequence[Step] = PREFILL_STEPS) -> Recorded:
    out = Recorded()
    for scenario in scenarios:
        for steps, is_decode in ((decode, True), (prefill, False)):
            for launch in record(scenario, steps) if steps else ():
                out.scenarios.setdefault(launch, set()).add(scenario.name)
                if is_decode:
                    out.in_decode.add(launch)
    return out


def reduced_config(model: str) -> ModelConfig:
    """The preset's widths with one layer of each kind, the first routed by token hash."""
    cfg = preset_config(model)
    return dataclasses.replace(cfg, num_layers=len(LAYER_KINDS), compress_ratios=LAYER_KINDS, num_hash_layers=1,
                               num_nextn_predict_layers=0)


def packed_formats_of(cfg: ModelConfig) -> dict[str, PackedFormat]:
    """The published checkpoints' precision for every weight that stays packed."""
    return {t.name: PackedFormat(t.quant, "fp32" if t.scale_dtype == "F32" else "e8m0")
            for t in checkpoint_tensors(cfg) if t.quant is not None and can_stay_quantized(t.name)}


def meta_model(scenario: Scenario) -> DeepseekV4:
    """The scenario's model (or rank 0's shard) on the meta device, packed, on the Triton kernels."""
    cfg = reduced_config(scenario.model)
    split = None
    if scenario.tensor_parallel_size > 1:
        split = ParallelConfig(scenario.tensor_parallel_size, scenario.expert_parallel, rank=0)
    with torch.device("meta"):
        model = DeepseekV4(cfg, split).in_dtype(torch.bfloat16)  # packed buffers are bytes: the cast leaves them
        pack_model(model, packed_formats_of(cfg))
    model.use_kernels(load_kernels("triton", "cpu"))
    return model


def run_step(model: DeepseekV4, kv: DeviceKV, step: Step, table_width: int | None = None) -> None:
    """One forward of `step`'s shape (token ids and KV contents do not exist on the meta device),
    block tables padded to `table_width` when given."""
    block = model.cfg.block_size
    seqs = []
    for start, n in [*((c, 1) for c in step.decodes), *step.chunks]:
        blocks = -(-(start + n) // block)
        table = list(range(len(seqs) * blocks, (len(seqs) + 1) * blocks))  # distinct blocks per sequence
        seqs.append(SeqChunk(slot=len(seqs), block_table=table, start=start, num_new=n))
    meta = AttentionMetadata.build(seqs, [range(s.num_new) for s in seqs] if step.rows else None)
    meta.table_width = table_width
    if step.rows:
        meta.rowwise = RowLayout(step.rows)
    ids = torch.zeros(meta.num_tokens, dtype=torch.long, device="meta")
    model(ids, meta, kv)


def record(scenario: Scenario, steps: Sequence[Step]) -> dict[Launch, int]:
    """Every distinct specialization `steps` launch in `scenario`, with how often."""
    model = meta_model(scenario)
    cfg = model.cfg
    seqs = max(len(s.decodes) + len(s.chunks) for s in steps)
    blocks = seqs * max(-(-(start + n) // cfg.block_size) for s in steps
                        for start, n in [*((c, 1) for c in s.decodes), *s.chunks])
    record = key_record(cfg.head_dim, cfg.rope_dim, "bfloat16", scenario.kv_cache_dtype)
    kv = DeviceKV(KVLayout.from_config(cfg, record), num_slots=seqs, num_blocks=blocks, dtype=torch.bfloat16,
                  device="meta")
    with LaunchRecorder() as recorder, _shape_only_collectives(scenario.tensor_parallel_size):
        for step in steps:
            run_step(model, kv, step, step.table_width)
    return recorder.launches


class _ShapeOnlyCollectives:
    """`torch.distributed` as `engine/model/parallel/sharding.py` calls it, keeping shapes only: every rank's
    kernels see their own shard, and what a collective would bring from the others has the right
    shape (no values exist on the meta device anyway)."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size

    def get_world_size(self) -> int:
        return self.world_size

    def all_reduce(self, tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        pass

    def all_gather(self, parts: list[torch.Tensor], tensor: torch.Tensor, *args: Any, **kwargs: Any) -> None:
        for part in parts:
            part.copy_(tensor)


@contextlib.contextmanager
def _shape_only_collectives(world_size: int) -> Iterator[None]:
    if world_size == 1:
        yield
        return
    real = parallel_module.dist
    parallel_module.dist = _ShapeOnlyCollectives(world_size)  # type: ignore[assignment]
    try:
        yield
    finally:
        parallel_module.dist = real
