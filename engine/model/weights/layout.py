"""Checkpoint layouts: which official DeepSeek-V4 tensors a checkpoint's tensors stand for, and the
plan of reads that yields them, checked against the model from the headers alone.

Three spellings of the same weights are accepted and mapped onto the official names that
v4serve's model uses as its state_dict keys:

* official (`layers.0.attn.wq_a.weight`, `ffn.experts.3.w1.weight`, FP8 `.scale` companions);
* transformers' in-memory `DeepseekV4ForCausalLM` names (`model.layers.0.self_attn.q_a_proj.weight`,
  merged `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I], `lm_head.weight`, ...);
* what transformers' `save_pretrained` writes: official names under `model.`, except
  `model.embed_tokens.weight`, `model.hc_head.hc_{fn,base,scale}`, `attn.norm` for the window
  `kv_norm`, and a top-level `head.weight`.

Each quantized weight is paired with its scale, and each read (a `Unit`: a tensor, or one expert of a
merged tensor) is listed with the official tensors it yields. That `Plan` is checked against
`expected` before any tensor data is read, so a wrong checkpoint fails in seconds rather than after
reading 100 GB. Under tensor or expert parallelism a rank's `Sharding` picks its slice of each
tensor; a slice that would cut an FP8 128x128 scale block or an FP4 32-value group is refused here,
before any tensor data is read. The capacity plan (`scan_headers`) and the choice of weights that stay
packed (`packed_formats`) read the same plan, so they cannot disagree with what loader.py loads.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from v4serve.engine.model.weights.files import (
    FLOAT_DTYPES,
    FP4_DTYPES,
    FP8_DTYPES,
    INT_DTYPES,
    PACKED_FP4_DTYPES,
    CheckpointError,
    Stored,
    fp8_tile,
    read_headers,
    shard_files,
    short_list,
)
from v4serve.engine.model.weights.packed import PackedFormat
from v4serve.engine.model.weights.quant import FP4_GROUP, FP8_BLOCK, fp4_scale_shape, fp8_scale_shape
from v4serve.engine.model.weights.resident import can_stay_quantized

# transformers' names, below `layers.{i}.` (and a multi-token-prediction block's `mtp.{k}.`), and the
# official names they stand for. A source
# ending in "." matches as a prefix (the rest, e.g. "weight", is kept); otherwise it must match the
# whole remainder. Longest source first so the compressor/indexer entries win over the bare ones.
_LAYER_ALIASES: tuple[tuple[str, str], ...] = tuple(
    sorted(
        (
            ("self_attn.compressor.indexer.scorer.weights_proj.", "attn.indexer.weights_proj."),
            ("self_attn.compressor.indexer.q_b_proj.", "attn.indexer.wq_b."),
            ("self_attn.compressor.indexer.position_bias", "attn.indexer.compressor.ape"),
            ("self_attn.compressor.indexer.kv_proj.", "attn.indexer.compressor.wkv."),
            ("self_attn.compressor.indexer.gate_proj.", "attn.indexer.compressor.wgate."),
            ("self_attn.compressor.indexer.kv_norm.", "attn.indexer.compressor.norm."),
            ("self_attn.compressor.position_bias", "attn.compressor.ape"),
            ("self_attn.compressor.kv_proj.", "attn.compressor.wkv."),
            ("self_attn.compressor.gate_proj.", "attn.compressor.wgate."),
            ("self_attn.compressor.kv_norm.", "attn.compressor.norm."),
            ("self_attn.sinks", "attn.attn_sink"),
            ("self_attn.q_a_proj.", "attn.wq_a."),
            ("self_attn.q_a_norm.", "attn.q_norm."),
            ("self_attn.q_b_proj.", "attn.wq_b."),
            ("self_attn.kv_proj.", "attn.wkv."),
            ("self_attn.kv_norm.", "attn.kv_norm."),
            ("self_attn.o_a_proj.", "attn.wo_a."),
            ("self_attn.o_b_proj.", "attn.wo_b."),
            # save_pretrained turns the window kv_norm into `attn.norm` (its compressor rule reversed).
            ("attn.norm.", "attn.kv_norm."),
            ("input_layernorm.", "attn_norm."),
            ("post_attention_layernorm.", "ffn_norm."),
            ("attn_hc.fn", "hc_attn_fn"),
            ("attn_hc.base", "hc_attn_base"),
            ("attn_hc.scale", "hc_attn_scale"),
            ("ffn_hc.fn", "hc_ffn_fn"),
            ("ffn_hc.base", "hc_ffn_base"),
            ("ffn_hc.scale", "hc_ffn_scale"),
            ("mlp.gate.e_score_correction_bias", "ffn.gate.bias"),
            ("mlp.gate.", "ffn.gate."),
            ("mlp.shared_experts.gate_proj.", "ffn.shared_experts.w1."),
            ("mlp.shared_experts.up_proj.", "ffn.shared_experts.w3."),
            ("mlp.shared_experts.down_proj.", "ffn.shared_experts.w2."),
            ("mlp.experts.gate_up_proj", "ffn.experts.gate_up_proj"),
            ("mlp.experts.down_proj", "ffn.experts.down_proj"),
            # An MTP block's own mHC head, spelled as the model's (its projections and norms keep their names).
            ("hc_head.hc_fn", "hc_head_fn"),
            ("hc_head.hc_base", "hc_head_base"),
            ("hc_head.hc_scale", "hc_head_scale"),
        ),
        key=lambda pair: -len(pair[0]),
    )
)

_TOP_ALIASES: dict[str, str] = {
    "embed_tokens.weight": "embed.weight",
    "lm_head.weight": "head.weight",
    "hc_head.hc_fn": "hc_head_fn",
    "hc_head.hc_base": "hc_head_base",
    "hc_head.hc_scale": "hc_head_scale",
}

_LAYER_KEY = re.compile(r"^((?:layers|mtp)\.\d+)\.(.+)$")
_MERGED_EXPERTS = re.compile(r"^((?:layers|mtp)\.\d+)\.ffn\.experts\.(gate_up_proj|down_proj)$")


@dataclass(frozen=True)
class TensorSlice:
    """The part of an official tensor one rank holds: [start, stop) along `axis` of its logical shape
    (FP4 unpacked, one expert; 0 = rows, 1 = columns of a weight)."""

    axis: int
    start: int
    stop: int


class Sharding(Protocol):
    """Which official tensors a rank holds, and which slice of each (None: all of it)."""

    def holds(self, name: str) -> bool: ...

    def slice_of(self, name: str, shape: tuple[int, ...]) -> TensorSlice | None: ...


@dataclass
class Unit:
    """One read from the checkpoint (a tensor, or one expert of a merged tensor) and the official
    tensors it yields: (name, rows) with rows=None for the whole thing."""

    weight: Stored
    scale: Stored | None = None
    expert: int | None = None
    outputs: list[tuple[str, slice | None]] = field(default_factory=list)
    parts: dict[str, TensorSlice] = field(default_factory=dict)  # a rank's slice of some outputs
    # The logical block one scale covers: FP8 the checkpoint's tile (or one row of 32, as V4.1 stores
    # its Engram tables), FP4 one row of FP4_GROUP.
    tile: tuple[int, int] = FP8_BLOCK

    @property
    def quant(self) -> str:
        if self.scale is None:
            return "none"
        return "fp8" if self.weight.dtype in FP8_DTYPES else "fp4"

    def logical_shape(self) -> tuple[int, ...]:
        """Shape after unpacking FP4 and picking the expert, before the row split."""
        shape = self.weight.shape
        if self.quant == "fp4" and self.weight.dtype in PACKED_FP4_DTYPES:
            shape = (*shape[:-1], shape[-1] * 2)
        return shape[1:] if self.expert is not None else shape

    def output_shape(self, rows: slice | None, part: TensorSlice | None = None) -> tuple[int, ...]:
        shape = self.logical_shape()
        if rows is not None:
            shape = (len(range(*rows.indices(shape[0]))), *shape[1:])
        if part is not None:
            shape = (*shape[:part.axis], part.stop - part.start, *shape[part.axis + 1:])
        return shape

    def region(self, rows: slice | None, part: TensorSlice | None) -> tuple[slice, ...]:
        """Where one output lies in the stored tensor (its expert), in logical indices per dim."""
        shape = self.logical_shape()
        region = [slice(0, n) for n in shape]
        if rows is not None:
            region[0] = slice(*rows.indices(shape[0])[:2])
        if part is not None:
            at = region[part.axis].start
            region[part.axis] = slice(at + part.start, at + part.stop)
        return tuple(region)


# ---------------------------------------------------------------------------------------------
# Names


def official_name(key: str) -> str:
    """Map one checkpoint key of any accepted spelling to its official name. Merged expert tensors
    map to `layers.{i}.ffn.experts.{gate_up_proj,down_proj}`, which the planner splits."""
    name = key[len("model.") :] if key.startswith("model.") else key
    if name in _TOP_ALIASES:
        return _TOP_ALIASES[name]
    match = _LAYER_KEY.match(name)
    if match is None:
        return name
    block, rest = match.groups()
    for source, target in _LAYER_ALIASES:
        if rest == source or (source.endswith(".") and rest.startswith(source)):
            return f"{block}.{target}{rest[len(source) :]}"
    return name


def _scale_candidates(key: str) -> list[str]:
    """Where a quantized tensor's scale may live: official `X.scale`, transformers' `X.weight_scale_inv`
    (and the merged experts' `gate_up_proj_scale_inv`)."""
    names = [f"{key}_scale_inv", f"{key}_scale", f"{key}.scale"]
    if key.endswith(".weight"):
        names.insert(0, f"{key[: -len('.weight')]}.scale")
    return names


def _pair_scales(stored: Mapping[str, Stored]) -> tuple[dict[str, Stored | None], list[str]]:
    """Split headers into weights (each with its scale, if quantized) and unpaired FP8 tensors."""
    quantized = FP8_DTYPES | PACKED_FP4_DTYPES | FP4_DTYPES
    weights: dict[str, Stored | None] = {}
    consumed: set[str] = set()
    for key, entry in stored.items():
        if entry.dtype not in quantized:
            continue
        scale_key = next((c for c in _scale_candidates(key) if c in stored), None)
        if scale_key is not None:
            weights[key] = stored[scale_key]
            consumed.add(scale_key)
    unscaled_fp8 = [k for k, e in stored.items() if e.dtype in FP8_DTYPES and k not in weights]
    for key in stored:
        if key not in consumed and key not in weights:
            weights[key] = None
    return weights, unscaled_fp8


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


# ---------------------------------------------------------------------------------------------
# Plan: which reads produce which official tensors, checked against `expected` up front


@dataclass
class Plan:
    units: list[Unit] = field(default_factory=list)
    sources: dict[str, Unit] = field(default_factory=dict)
    skipped_mtp: int = 0
    skipped: dict[str, int] = field(default_factory=dict)  # tensors left out, by the reason given for them
    problems: list[str] = field(default_factory=list)


def plan_units(stored: Mapping[str, Stored], mtp: bool = False, fp8_block: tuple[int, int] = FP8_BLOCK,
               skip: Mapping[str, str] | None = None) -> Plan:
    """How to read every tensor of a checkpoint; multi-token-prediction ones (`mtp.*`) only with `mtp`
    (counted as skipped otherwise). `fp8_block`: the FP8 scale tile the checkpoint declares. `skip`: name
    prefixes the model does not load, each with the reason (counted, never read)."""
    plan = Plan()
    weights, unscaled_fp8 = _pair_scales(stored)
    for key in unscaled_fp8:
        plan.problems.append(
            f"FP8 tensor {stored[key].where()} has no scale (looked for {short_list(_scale_candidates(key), 4)})"
        )
    for key, scale in weights.items():
        entry = stored[key]
        name = official_name(key)
        reason = next((why for prefix, why in (skip or {}).items() if name.startswith(prefix)), None)
        if reason is not None:
            plan.skipped[reason] = plan.skipped.get(reason, 0) + 1 + (scale is not None)
            continue
        if name.startswith("mtp.") and not (mtp and name.startswith("mtp.0.")):  # the first layer serves
            plan.skipped_mtp += 1
            continue
        merged = _MERGED_EXPERTS.match(name)
        if merged:
            _plan_merged(plan, entry, scale, merged.group(1), merged.group(2))
        else:
            _add(plan, Unit(entry, scale, outputs=[(name, None)]))
    for unit in plan.units:
        unit.tile = _tile(unit, fp8_block)
    return plan


def _tile(unit: Unit, fp8_block: tuple[int, int]) -> tuple[int, int]:
    """The block each of a unit's scales covers, told by its scale's shape where the checkpoint's tile
    does not fit it: V4.1 keeps one scale per row and 32 columns for its FP8 Engram tables."""
    if unit.quant == "fp4":
        return 1, FP4_GROUP
    if unit.quant == "fp8" and unit.scale is not None:
        logical = unit.weight.shape
        for tile in (fp8_block, (1, FP4_GROUP)):
            if tuple(unit.scale.shape) == fp8_scale_shape(logical, tile):
                return tile
    return fp8_block


def _plan_merged(plan: Plan, entry: Stored, scale: Stored | None, block: str, which: str) -> None:
    """One read per expert of `block` (`layers.3`, `mtp.0`); gate_up_proj rows [0, I) are w1 (gate),
    rows [I, 2I) are w3 (up)."""
    if len(entry.shape) != 3:
        plan.problems.append(f"merged expert tensor {entry.where()} should be 3-D, found {list(entry.shape)}")
        return
    prefix = f"{block}.ffn.experts"
    for expert in range(entry.shape[0]):
        unit = Unit(entry, scale, expert=expert)
        if which == "down_proj":
            unit.outputs = [(f"{prefix}.{expert}.w2.weight", None)]
        else:
            inter = unit.logical_shape()[0] // 2
            unit.outputs = [
                (f"{prefix}.{expert}.w1.weight", slice(0, inter)),
                (f"{prefix}.{expert}.w3.weight", slice(inter, 2 * inter)),
            ]
        _add(plan, unit)


def _add(plan: Plan, unit: Unit) -> None:
    plan.units.append(unit)
    for name, _ in unit.outputs:
        if name in plan.sources:
            plan.problems.append(
                f"{name} is given twice: by {plan.sources[name].weight.where()} and by {unit.weight.where()}"
            )
        plan.sources[name] = unit


def check_plan(plan: Plan, expected: Mapping[str, tuple[Any, torch.dtype]]) -> list[str]:
    problems = list(plan.problems)
    missing = [name for name in expected if name not in plan.sources]
    unexpected = [f"{name} ({unit.weight.where()})" for name, unit in plan.sources.items() if name not in expected]
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {short_list(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {short_list(unexpected)}")
    shapes, dtypes = [], []
    for unit in plan.units:
        for name, rows in unit.outputs:
            if name in expected:
                shapes.extend(_check_shape(unit, name, rows, tuple(expected[name][0])))
                dtypes.extend(_check_dtype(unit, name, expected[name][1]))
            if name in unit.parts:
                problems.extend(_check_part(unit, name, rows))
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es):" + short_list(shapes, sep="\n    ", lead="\n    "))
    if dtypes:
        problems.append(f"{len(dtypes)} dtype problem(s):" + short_list(dtypes, sep="\n    ", lead="\n    "))
    scales = {u.weight.key: u for u in plan.units if u.scale is not None}
    problems.extend(p for unit in scales.values() for p in _check_scale_shape(unit))
    return problems


def _check_shape(unit: Unit, name: str, rows: slice | None, want: tuple[int, ...]) -> list[str]:
    found = unit.output_shape(rows, unit.parts.get(name))
    if found == want:
        return []
    return [f"{name}: expected {list(want)}, found {list(found)} ({unit.weight.where()})"]


def _check_dtype(unit: Unit, name: str, want: torch.dtype | None) -> list[str]:
    stored = unit.weight.dtype
    if want is not None and not want.is_floating_point:
        if unit.scale is not None or stored not in INT_DTYPES:
            return [f"{name} must be an integer tensor, found {stored} ({unit.weight.where()})"]
    elif unit.scale is None and stored not in FLOAT_DTYPES:
        return [f"{name} must be a floating tensor, found {stored} without a scale ({unit.weight.where()})"]
    return []


def _check_part(unit: Unit, name: str, rows: slice | None) -> list[str]:
    """A rank's slice of a quantized tensor must hold whole scale blocks: FP8 128x128 tiles (rows and
    columns), FP4 32-value groups (columns; rows are free). A slice may end at the tensor's edge."""
    part = unit.parts[name]
    if unit.quant == "none":
        return []
    if unit.weight.dtype in FP4_DTYPES:
        return [f"{name}: safetensors cannot read part of float4 tensor {unit.weight.where()}; "
                "store FP4 codes as int8 pairs (the official layout) to shard it"]
    last = part.axis == len(unit.logical_shape()) - 1
    if unit.quant == "fp8":
        block, what = unit.tile[part.axis], f"{unit.tile[0]}x{unit.tile[1]} scale block"
    else:
        block, what = (FP4_GROUP if last else 1), f"{FP4_GROUP}-value scale group"
    span = unit.region(rows, part)[part.axis]
    if span.start % block == 0 and (span.stop % block == 0 or span.stop == unit.logical_shape()[part.axis]):
        return []
    return [f"{name}: this rank's {'columns' if last else 'rows'} [{span.start}, {span.stop}) of "
            f"{unit.weight.where()} would split an {unit.quant.upper()} {what}; choose a tensor-parallel size "
            "whose shards hold whole blocks, or store the checkpoint unquantized"]


def _check_scale_shape(unit: Unit) -> list[str]:
    assert unit.scale is not None
    logical = unit.weight.shape
    if unit.quant == "fp4" and unit.weight.dtype in PACKED_FP4_DTYPES:
        logical = (*logical[:-1], logical[-1] * 2)
    if len(logical) < 2:
        return [f"quantized tensor {unit.weight.where()} must be at least 2-D, found {list(logical)}"]
    want = fp8_scale_shape(logical, unit.tile) if unit.quant == "fp8" else fp4_scale_shape(logical, FP4_GROUP)
    if tuple(unit.scale.shape) == want:
        return []
    needs = f"{list(want)}"
    if unit.quant == "fp8":
        rowwise = fp8_scale_shape(logical, (1, FP4_GROUP))
        needs += f" ({unit.tile[0]}x{unit.tile[1]} tiles) or {list(rowwise)} (one per row and {FP4_GROUP} columns)"
    return [
        f"scale {unit.scale.where()} has shape {list(unit.scale.shape)}, but {unit.weight.where()} "
        f"of shape {list(unit.weight.shape)} needs {needs}"
    ]


# ---------------------------------------------------------------------------------------------
# Headers only (the capacity plan, packed residency)


def packed_formats(path: str | Path, mtp: bool = False) -> dict[str, PackedFormat]:
    """From the headers alone: the quantized weights that can stay packed when resident
    (`resident.can_stay_quantized`), by official name; the multi-token-prediction layer's too with `mtp`.
    A merged FP8 expert tensor whose halves do not split on a 128-row scale block is left out (it is
    dequantized at load)."""
    files, weight_map = shard_files(Path(path))
    plan = plan_units(read_headers(files, weight_map), mtp, fp8_tile(path, FP8_BLOCK))
    out: dict[str, PackedFormat] = {}
    for unit in plan.units:
        if unit.scale is None:
            continue
        scale = "e8m0" if unit.scale.dtype in ("F8_E8M0", "U8") else "fp32"
        # The packed kernels read V4's tiles: other tiles are dequantized at load.
        aligned = unit.quant == "fp4" or (unit.tile == FP8_BLOCK and all(rows is None or rows.start % FP8_BLOCK[0] == 0
                                                                        for _, rows in unit.outputs))
        names = [name for name, _ in unit.outputs]
        if aligned and unit.weight.dtype != "F8_E5M2" and all(map(can_stay_quantized, names)):
            out.update(dict.fromkeys(names, PackedFormat(unit.quant, scale)))
    return out


@dataclass(frozen=True)
class HeaderScan:
    """What a checkpoint folder holds, from its safetensors headers alone. `tensors` has one entry
    per official tensor the loader would produce: (official name, logical shape (FP4 unpacked, one
    expert of a merged tensor, its w1/w3 half), stored dtype, scale dtype or None)."""

    tensors: tuple[tuple[str, tuple[int, ...], str, str | None], ...]
    mtp_tensors: int  # multi-token-prediction tensors (scales included) the loader skips
    mtp_bytes: int


def scan_headers(path: str | Path, mtp: bool = False) -> HeaderScan:
    """Every tensor of a checkpoint as `load_checkpoint` would read it, without reading tensor data.
    Raises CheckpointError for what the loader would refuse before reading (unpaired FP8 tensors,
    duplicates, unreadable headers)."""
    files, weight_map = shard_files(Path(path))
    stored = read_headers(files, weight_map)
    plan = plan_units(stored, mtp, fp8_tile(path, FP8_BLOCK))
    if plan.problems:
        raise CheckpointError(f"checkpoint {path} cannot be loaded:\n  " + "\n  ".join(plan.problems))
    tensors = tuple(
        (name, unit.output_shape(rows), unit.weight.dtype, unit.scale.dtype if unit.scale else None)
        for unit in plan.units
        for name, rows in unit.outputs
    )
    skipped = [entry for key, entry in stored.items() if official_name(key).startswith("mtp.")
               and not (mtp and official_name(key).startswith("mtp.0."))]  # as plan_units
    return HeaderScan(tensors, len(skipped), sum(entry.nbytes for entry in skipped))
