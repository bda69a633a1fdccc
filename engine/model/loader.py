"""Checkpoint loading: safetensors folders -> tensors keyed by DeepSeek-V4's official names.

Three spellings of the same weights are accepted and mapped onto the official names that
v4serve's model uses as its state_dict keys:

* official (`layers.0.attn.wq_a.weight`, `ffn.experts.3.w1.weight`, FP8 `.scale` companions);
* transformers' in-memory `DeepseekV4ForCausalLM` names (`model.layers.0.self_attn.q_a_proj.weight`,
  merged `mlp.experts.gate_up_proj` [E, 2I, D] / `down_proj` [E, D, I], `lm_head.weight`, ...);
* what transformers' `save_pretrained` writes: official names under `model.`, except
  `model.embed_tokens.weight`, `model.hc_head.hc_{fn,base,scale}`, `attn.norm` for the window
  `kv_norm`, and a top-level `head.weight`.

Every header is read and checked against `expected` before any tensor data is, so a wrong
checkpoint fails in seconds rather than after reading 100 GB. Tensors are then read one by one
(merged experts one expert slab at a time) and dequantized as they come, keeping peak memory
close to the size of the result.

Under tensor or expert parallelism (engine/model/parallel.py) a rank passes its `Sharding`: only the
tensors it holds are read, each through safetensors' `get_slice`, so a rank reads its rows or
columns and never a whole split tensor. Quantized weights are sliced as stored (codes with the
scales that cover them), so they can stay packed; a slice that would cut an FP8 128x128 scale block
or an FP4 32-value group is refused before any tensor data is read.
"""

from __future__ import annotations

import json
import logging
import math
import re
import sys
import time
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from safetensors import safe_open

from v4serve.engine.model.packed import PackedFormat
from v4serve.engine.model.quant import (
    FP4_GROUP,
    FP8_BLOCK,
    dequant_fp4_packed,
    dequant_fp8_block,
    fp4_scale_shape,
    fp8_scale_shape,
)
from v4serve.engine.model.resident import can_stay_quantized

log = logging.getLogger(__name__)

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_LIST_LIMIT = 10
_HEARTBEAT_S = 10.0

_FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}
_PACKED_FP4_DTYPES = {"I8", "U8"}  # two codes per byte: the header holds the packed shape
_FP4_DTYPES = {"F4"}  # float4_e2m1fn_x2: the header already holds the logical shape
_FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
_INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
_ITEM_BYTES = {
    "F64": 8,
    "I64": 8,
    "U64": 8,
    "F32": 4,
    "I32": 4,
    "U32": 4,
    "F16": 2,
    "BF16": 2,
    "I16": 2,
    "U16": 2,
    "F4": 0.5,
}  # everything else is one byte

# transformers' names, below `layers.{i}.`, and the official names they stand for. A source
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

_LAYER_KEY = re.compile(r"^layers\.(\d+)\.(.+)$")
_MERGED_EXPERTS = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(gate_up_proj|down_proj)$")


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as the expected model; the message names the tensors."""


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


@dataclass(frozen=True)
class _Stored:
    """One tensor as the safetensors header describes it."""

    file: Path
    key: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return int(math.prod(self.shape) * _ITEM_BYTES.get(self.dtype, 1))

    def where(self) -> str:
        return f"'{self.key}' in {self.file.name}"


@dataclass
class _Unit:
    """One read from the checkpoint (a tensor, or one expert of a merged tensor) and the official
    tensors it yields: (name, rows) with rows=None for the whole thing."""

    weight: _Stored
    scale: _Stored | None = None
    expert: int | None = None
    outputs: list[tuple[str, slice | None]] = field(default_factory=list)
    parts: dict[str, TensorSlice] = field(default_factory=dict)  # a rank's slice of some outputs

    @property
    def quant(self) -> str:
        if self.scale is None:
            return "none"
        return "fp8" if self.weight.dtype in _FP8_DTYPES else "fp4"

    def logical_shape(self) -> tuple[int, ...]:
        """Shape after unpacking FP4 and picking the expert, before the row split."""
        shape = self.weight.shape
        if self.quant == "fp4" and self.weight.dtype in _PACKED_FP4_DTYPES:
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
# Files


def read_config_json(path: str | Path) -> dict[str, Any]:
    """The checkpoint's config.json as a dict; `path` is the checkpoint folder or the file itself."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path
    if not file.is_file():
        where = f"folder {path}" if path.is_dir() else f"{path}"
        raise CheckpointError(f"no {CONFIG_FILE} found at {where}")
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {file}: {err}") from err
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object, found {type(data).__name__}")
    return data


def _shard_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
    """Safetensors files to read, in order, and the index's weight map when there is one."""
    if path.is_file():
        return [path], None
    if not path.is_dir():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    index_file = path / INDEX_FILE
    if index_file.is_file():
        weight_map = _read_index(index_file)
        shards = sorted(set(weight_map.values()))
        missing = [name for name in shards if not (path / name).is_file()]
        if missing:
            users = [k for k, v in weight_map.items() if v == missing[0]]
            raise CheckpointError(
                f"{INDEX_FILE} in {path} points at {len(missing)} missing shard file(s): "
                f"{_short(missing)} (e.g. {missing[0]} should hold {_short(users, 3)})"
            )
        return [path / name for name in shards], weight_map
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE], None
    files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(f"no safetensors files in {path} (looked for {INDEX_FILE}, {SINGLE_FILE}, *.safetensors)")
    return files, None


def _read_index(index_file: Path) -> dict[str, str]:
    try:
        weight_map = json.loads(index_file.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as err:
        raise CheckpointError(f"cannot read the weight_map of {index_file}: {err!r}") from err
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise CheckpointError(f"{index_file}: weight_map must map tensor names to shard file names")
    return weight_map


def _scan(files: Sequence[Path], weight_map: Mapping[str, str] | None) -> dict[str, _Stored]:
    """Every tensor's header entry; no tensor data is read."""
    stored: dict[str, _Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    sl = handle.get_slice(key)
                    if key in stored:
                        raise CheckpointError(f"tensor '{key}' appears in both {stored[key].file.name} and {file.name}")
                    stored[key] = _Stored(file, key, sl.get_dtype(), tuple(sl.get_shape()))
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read safetensors header of {file}: {err}") from err
    if weight_map is not None:
        absent = [k for k, shard in weight_map.items() if k not in stored]
        if absent:
            raise CheckpointError(
                f"{INDEX_FILE} lists {len(absent)} tensor(s) its shards do not hold: "
                f"{_short([f'{k} (in {weight_map[k]})' for k in absent])}"
            )
    return stored


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
    layer, rest = match.groups()
    for source, target in _LAYER_ALIASES:
        if rest == source or (source.endswith(".") and rest.startswith(source)):
            return f"layers.{layer}.{target}{rest[len(source) :]}"
    return name


def _scale_candidates(key: str) -> list[str]:
    """Where a quantized tensor's scale may live: official `X.scale`, transformers' `X.weight_scale_inv`
    (and the merged experts' `gate_up_proj_scale_inv`)."""
    names = [f"{key}_scale_inv", f"{key}_scale", f"{key}.scale"]
    if key.endswith(".weight"):
        names.insert(0, f"{key[: -len('.weight')]}.scale")
    return names


def _pair_scales(stored: Mapping[str, _Stored]) -> tuple[dict[str, _Stored | None], list[str]]:
    """Split headers into weights (each with its scale, if quantized) and unpaired FP8 tensors."""
    quantized = _FP8_DTYPES | _PACKED_FP4_DTYPES | _FP4_DTYPES
    weights: dict[str, _Stored | None] = {}
    consumed: set[str] = set()
    for key, entry in stored.items():
        if entry.dtype not in quantized:
            continue
        scale_key = next((c for c in _scale_candidates(key) if c in stored), None)
        if scale_key is not None:
            weights[key] = stored[scale_key]
            consumed.add(scale_key)
    unscaled_fp8 = [k for k, e in stored.items() if e.dtype in _FP8_DTYPES and k not in weights]
    for key in stored:
        if key not in consumed and key not in weights:
            weights[key] = None
    return weights, unscaled_fp8


# ---------------------------------------------------------------------------------------------
# Plan: which reads produce which official tensors, checked against `expected` up front


@dataclass
class _Plan:
    units: list[_Unit] = field(default_factory=list)
    sources: dict[str, _Unit] = field(default_factory=dict)
    skipped_mtp: int = 0
    problems: list[str] = field(default_factory=list)


def _plan(stored: Mapping[str, _Stored]) -> _Plan:
    plan = _Plan()
    weights, unscaled_fp8 = _pair_scales(stored)
    for key in unscaled_fp8:
        plan.problems.append(
            f"FP8 tensor {stored[key].where()} has no scale (looked for {_short(_scale_candidates(key), 4)})"
        )
    for key, scale in weights.items():
        entry = stored[key]
        name = official_name(key)
        if name.startswith("mtp."):
            plan.skipped_mtp += 1
            continue
        merged = _MERGED_EXPERTS.match(name)
        if merged:
            _plan_merged(plan, entry, scale, int(merged.group(1)), merged.group(2))
        else:
            _add(plan, _Unit(entry, scale, outputs=[(name, None)]))
    return plan


def _plan_merged(plan: _Plan, entry: _Stored, scale: _Stored | None, layer: int, which: str) -> None:
    """One read per expert; gate_up_proj rows [0, I) are w1 (gate), rows [I, 2I) are w3 (up)."""
    if len(entry.shape) != 3:
        plan.problems.append(f"merged expert tensor {entry.where()} should be 3-D, found {list(entry.shape)}")
        return
    prefix = f"layers.{layer}.ffn.experts"
    for expert in range(entry.shape[0]):
        unit = _Unit(entry, scale, expert=expert)
        if which == "down_proj":
            unit.outputs = [(f"{prefix}.{expert}.w2.weight", None)]
        else:
            inter = unit.logical_shape()[0] // 2
            unit.outputs = [
                (f"{prefix}.{expert}.w1.weight", slice(0, inter)),
                (f"{prefix}.{expert}.w3.weight", slice(inter, 2 * inter)),
            ]
        _add(plan, unit)


def _add(plan: _Plan, unit: _Unit) -> None:
    plan.units.append(unit)
    for name, _ in unit.outputs:
        if name in plan.sources:
            plan.problems.append(
                f"{name} is given twice: by {plan.sources[name].weight.where()} and by {unit.weight.where()}"
            )
        plan.sources[name] = unit


def _check(plan: _Plan, expected: Mapping[str, tuple[Any, torch.dtype]]) -> list[str]:
    problems = list(plan.problems)
    missing = [name for name in expected if name not in plan.sources]
    unexpected = [f"{name} ({unit.weight.where()})" for name, unit in plan.sources.items() if name not in expected]
    if missing:
        problems.append(f"missing {len(missing)} tensor(s): {_short(missing)}")
    if unexpected:
        problems.append(f"unexpected {len(unexpected)} tensor(s): {_short(unexpected)}")
    shapes, dtypes = [], []
    for unit in plan.units:
        for name, rows in unit.outputs:
            if name in expected:
                shapes.extend(_check_shape(unit, name, rows, tuple(expected[name][0])))
                dtypes.extend(_check_dtype(unit, name, expected[name][1]))
            if name in unit.parts:
                problems.extend(_check_part(unit, name, rows))
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es):" + _short(shapes, sep="\n    ", lead="\n    "))
    if dtypes:
        problems.append(f"{len(dtypes)} dtype problem(s):" + _short(dtypes, sep="\n    ", lead="\n    "))
    scales = {u.weight.key: u for u in plan.units if u.scale is not None}
    problems.extend(p for unit in scales.values() for p in _check_scale_shape(unit))
    return problems


def _check_shape(unit: _Unit, name: str, rows: slice | None, want: tuple[int, ...]) -> list[str]:
    found = unit.output_shape(rows, unit.parts.get(name))
    if found == want:
        return []
    return [f"{name}: expected {list(want)}, found {list(found)} ({unit.weight.where()})"]


def _check_dtype(unit: _Unit, name: str, want: torch.dtype | None) -> list[str]:
    stored = unit.weight.dtype
    if want is not None and not want.is_floating_point:
        if unit.scale is not None or stored not in _INT_DTYPES:
            return [f"{name} must be an integer tensor, found {stored} ({unit.weight.where()})"]
    elif unit.scale is None and stored not in _FLOAT_DTYPES:
        return [f"{name} must be a floating tensor, found {stored} without a scale ({unit.weight.where()})"]
    return []


def _check_part(unit: _Unit, name: str, rows: slice | None) -> list[str]:
    """A rank's slice of a quantized tensor must hold whole scale blocks: FP8 128x128 tiles (rows and
    columns), FP4 32-value groups (columns; rows are free). A slice may end at the tensor's edge."""
    part = unit.parts[name]
    if unit.quant == "none":
        return []
    if unit.weight.dtype in _FP4_DTYPES:
        return [f"{name}: safetensors cannot read part of float4 tensor {unit.weight.where()}; "
                "store FP4 codes as int8 pairs (the official layout) to shard it"]
    last = part.axis == len(unit.logical_shape()) - 1
    if unit.quant == "fp8":
        block, what = FP8_BLOCK[part.axis], f"{FP8_BLOCK[0]}x{FP8_BLOCK[1]} scale block"
    else:
        block, what = (FP4_GROUP if last else 1), f"{FP4_GROUP}-value scale group"
    span = unit.region(rows, part)[part.axis]
    if span.start % block == 0 and (span.stop % block == 0 or span.stop == unit.logical_shape()[part.axis]):
        return []
    return [f"{name}: this rank's {'columns' if last else 'rows'} [{span.start}, {span.stop}) of "
            f"{unit.weight.where()} would split an {unit.quant.upper()} {what}; choose a tensor-parallel size "
            "whose shards hold whole blocks, or store the checkpoint unquantized"]


def _check_scale_shape(unit: _Unit) -> list[str]:
    assert unit.scale is not None
    logical = unit.weight.shape
    if unit.quant == "fp4" and unit.weight.dtype in _PACKED_FP4_DTYPES:
        logical = (*logical[:-1], logical[-1] * 2)
    if len(logical) < 2:
        return [f"quantized tensor {unit.weight.where()} must be at least 2-D, found {list(logical)}"]
    want = fp8_scale_shape(logical, FP8_BLOCK) if unit.quant == "fp8" else fp4_scale_shape(logical, FP4_GROUP)
    if tuple(unit.scale.shape) == want:
        return []
    return [
        f"scale {unit.scale.where()} has shape {list(unit.scale.shape)}, but {unit.weight.where()} "
        f"of shape {list(unit.weight.shape)} needs {list(want)}"
    ]


def _short(items: Iterable[str], limit: int = _LIST_LIMIT, sep: str = ", ", lead: str = "") -> str:
    items = list(items)
    shown = lead + sep.join(items[:limit])
    return shown if len(items) <= limit else f"{shown}{sep}... ({len(items) - limit} more)"


# ---------------------------------------------------------------------------------------------
# Reading


class _Handles:
    """Open safetensors files, kept open for the whole load (a scale may sit in another shard)."""

    def __init__(self) -> None:
        self._open: dict[Path, Any] = {}
        self._whole: tuple[_Stored, torch.Tensor] | None = None

    def _handle(self, entry: _Stored) -> Any:
        handle = self._open.get(entry.file)
        if handle is None:
            handle = self._open[entry.file] = safe_open(entry.file, framework="pt")
        return handle

    def read(self, entry: _Stored, expert: int | None = None) -> torch.Tensor:
        handle = self._handle(entry)
        if expert is None:
            return handle.get_tensor(entry.key)
        # Slicing one expert out of a merged tensor avoids materialising all experts at once.
        if entry.dtype not in _FP4_DTYPES:
            return handle.get_slice(entry.key)[expert]
        # safetensors cannot slice float4 storage: read it whole once and serve every expert from it.
        if self._whole is None or self._whole[0] != entry:
            self._whole = (entry, handle.get_tensor(entry.key))
        return self._whole[1][expert]

    def read_region(self, entry: _Stored, expert: int | None, region: tuple[slice, ...]) -> torch.Tensor:
        """Part of a stored tensor (of one expert), in stored indices: only these bytes are read."""
        return self._handle(entry).get_slice(entry.key)[region if expert is None else (expert, *region)]


def _materialize(
    unit: _Unit, handles: _Handles, dtype: torch.dtype, int_dtypes: dict[str, torch.dtype],
    packed: Mapping[str, PackedFormat],
) -> list[tuple[str, torch.Tensor]]:
    if unit.parts:
        return _sliced_outputs(unit, handles, dtype, int_dtypes, packed)
    tensor = handles.read(unit.weight, unit.expert)
    if unit.scale is not None and unit.outputs[0][0] in packed:
        return _packed_outputs(unit, tensor, handles.read(unit.scale, unit.expert), packed)
    if unit.scale is not None:
        scale = handles.read(unit.scale, unit.expert)
        try:
            if unit.quant == "fp8":
                tensor = dequant_fp8_block(tensor, scale, FP8_BLOCK, dtype)
            else:
                tensor = dequant_fp4_packed(tensor, scale, FP4_GROUP, dtype)
        except ValueError as err:
            raise CheckpointError(f"cannot dequantize {unit.weight.where()}: {err}") from err
    out = []
    for name, rows in unit.outputs:
        want = int_dtypes.get(name, dtype)
        if rows is None:
            out.append((name, tensor.to(want)))
        else:
            # A copy, so w1 and w3 do not share storage (which would trip anyone saving them).
            out.append((name, tensor[rows].to(want, copy=True)))
    return out


def _sliced_outputs(
    unit: _Unit, handles: _Handles, dtype: torch.dtype, int_dtypes: dict[str, torch.dtype],
    packed: Mapping[str, PackedFormat],
) -> list[tuple[str, torch.Tensor]]:
    """A rank's outputs of one unit, each read on its own: its region of the codes, and of the scales
    the region's whole blocks (`_check_part` made sure it holds whole ones), as the unsliced path
    would give them for a tensor of that shape."""
    out = []
    for name, rows in unit.outputs:
        region = unit.region(rows, unit.parts.get(name))
        tensor = handles.read_region(unit.weight, unit.expert, _stored_region(unit, region))
        if unit.scale is None:
            out.append((name, tensor.to(int_dtypes.get(name, dtype))))
            continue
        scale = handles.read_region(unit.scale, unit.expert, _scale_region(unit, region))
        if name in packed:
            codes, scale = _as_resident(tensor, scale)
            out += [(name, codes), (_scale_name(name), scale)]
        elif unit.quant == "fp8":
            out.append((name, dequant_fp8_block(tensor, scale, FP8_BLOCK, dtype)))
        else:
            out.append((name, dequant_fp4_packed(tensor, scale, FP4_GROUP, dtype)))
    return out


def _stored_region(unit: _Unit, region: tuple[slice, ...]) -> tuple[slice, ...]:
    """Logical indices → stored ones: packed FP4 holds two columns per byte."""
    if unit.quant != "fp4" or unit.weight.dtype not in _PACKED_FP4_DTYPES:
        return region
    cols = region[-1]
    return (*region[:-1], slice(cols.start // 2, -(-cols.stop // 2)))


def _scale_region(unit: _Unit, region: tuple[slice, ...]) -> tuple[slice, ...]:
    """The scales covering a region: FP8 one per 128x128 tile, FP4 one per 32 columns of a row."""
    def blocks(span: slice, size: int) -> slice:
        return slice(span.start // size, -(-span.stop // size))

    if unit.quant == "fp8":
        return (*region[:-2], blocks(region[-2], FP8_BLOCK[0]), blocks(region[-1], FP8_BLOCK[1]))
    return (*region[:-1], blocks(region[-1], FP4_GROUP))


def _as_resident(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales as a packed layer holds them: bytes, fp32 scales as int32 bits (see
    engine/model/packed.py)."""
    codes = codes.contiguous().view(torch.uint8)
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    elif scale.dtype != torch.uint8:
        scale = scale.to(torch.float32).view(torch.int32)
    return codes, scale


def _packed_outputs(unit: _Unit, codes: torch.Tensor, scale: torch.Tensor, packed: Mapping[str, PackedFormat]
                    ) -> list[tuple[str, torch.Tensor]]:
    """Codes and scales as stored (bytes; fp32 scales as int32 bits: see engine/model/packed.py),
    split by rows where a merged tensor holds two weights."""
    codes, scale = _as_resident(codes, scale)
    out = []
    for name, rows in unit.outputs:
        if rows is None:
            out += [(name, codes), (_scale_name(name), scale)]
            continue
        block = FP8_BLOCK[0] if packed[name].fmt == "fp8" else 1
        scale_rows = slice(rows.start // block, -(-rows.stop // block))
        out += [(name, codes[rows].clone()), (_scale_name(name), scale[scale_rows].clone())]
    return out


def _scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def packed_formats(path: str | Path) -> dict[str, PackedFormat]:
    """From the headers alone: the quantized weights that can stay packed when resident
    (`resident.can_stay_quantized`), by official name. A merged FP8 expert tensor whose halves do not
    split on a 128-row scale block is left out (it is dequantized at load)."""
    files, weight_map = _shard_files(Path(path))
    plan = _plan(_scan(files, weight_map))
    out: dict[str, PackedFormat] = {}
    for unit in plan.units:
        if unit.scale is None:
            continue
        scale = "e8m0" if unit.scale.dtype in ("F8_E8M0", "U8") else "fp32"
        aligned = unit.quant == "fp4" or all(rows is None or rows.start % FP8_BLOCK[0] == 0
                                             for _, rows in unit.outputs)
        names = [name for name, _ in unit.outputs]
        if aligned and unit.weight.dtype != "F8_E5M2" and all(map(can_stay_quantized, names)):
            out.update(dict.fromkeys(names, PackedFormat(unit.quant, scale)))
    return out


class _Progress:
    """A line per shard (and every few seconds inside a big one) so a long load never looks hung."""

    def __init__(self, files: Sequence[Path], enabled: bool) -> None:
        self.enabled = enabled
        self.sizes = {f: f.stat().st_size for f in files}
        self.total = sum(self.sizes.values())
        self.n_files = len(files)
        self.done = 0  # bytes of finished shards
        self.partial = 0  # tensor bytes read from the current shard
        self.start = self.last = time.monotonic()

    def emit(self, message: str) -> None:
        if not self.enabled:
            log.debug(message)
        elif log.hasHandlers():
            log.info(message)
        else:
            # Nobody configured logging: INFO would vanish, and a silent 100 GB load looks hung.
            print(f"v4serve: {message}", file=sys.stderr, flush=True)

    def tensor(self, shard_no: int, file: Path, count: int, of: int, nbytes: int) -> None:
        self.partial += nbytes
        now = time.monotonic()
        if now - self.last >= _HEARTBEAT_S:
            self.last = now
            self.emit(f"loading shard {shard_no}/{self.n_files} {file.name}: {count}/{of} tensors; {self._totals()}")

    def shard(self, shard_no: int, file: Path, count: int) -> None:
        self.done += self.sizes[file]
        self.partial = 0
        self.last = time.monotonic()
        self.emit(f"loaded shard {shard_no}/{self.n_files} {file.name}: {count} tensors; {self._totals()}")

    def _totals(self) -> str:
        elapsed = time.monotonic() - self.start
        done = min(self.done + self.partial, self.total)
        frac = done / self.total if self.total else 1.0
        eta = f", ~{elapsed * (1 - frac) / frac:.0f}s left" if 0 < frac < 1 else ""
        return f"{_gb(done)}/{_gb(self.total)} ({100 * frac:.0f}%) in {elapsed:.1f}s{eta}"


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


# ---------------------------------------------------------------------------------------------
# Entry point


def load_checkpoint(
    path: str | Path,
    expected: Mapping[str, tuple[Sequence[int] | torch.Size, torch.dtype]],
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    packed: Mapping[str, PackedFormat] | None = None,
) -> dict[str, torch.Tensor]:
    """Load a safetensors checkpoint (a folder with `model.safetensors`, an index and its shards, or
    any `*.safetensors`; or a single file) as {official name: tensor}, in `expected`'s order.
    `stream_checkpoint` yields the same tensors one at a time."""
    loaded = dict(stream_checkpoint(path, expected, dtype, progress, packed))
    return {name: loaded[name] for name in expected}


def stream_checkpoint(
    path: str | Path,
    expected: Mapping[str, tuple[Sequence[int] | torch.Size, torch.dtype]],
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    packed: Mapping[str, PackedFormat] | None = None,
    sharding: Sharding | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) for every tensor of `expected`, read one at a time, so the caller can
    put each on its device before the next is read (no whole-model copy in host memory).

    `expected` maps every official name the model needs to (shape, dtype). Floating tensors, FP8 and
    FP4 ones dequantized, come back as `dtype`; tensors whose expected dtype is an integer type
    (`ffn.gate.tid2eid`) come back as that type. Weights named in `packed` (see `packed_formats`)
    come back as stored instead: their codes as bytes, then `NAME.scale` (e8m0 bytes, or fp32 scales
    as int32 bits). Multi-token-prediction tensors (`mtp.*`) are skipped. Raises CheckpointError
    naming the offending tensors, before any tensor data is read, when the checkpoint does not match.
    `sharding`: one rank's part (module docstring); `expected` then holds that rank's shapes.
    """
    path = Path(path)
    packed = dict(packed or {})
    files, weight_map = _shard_files(path)
    plan = _plan(_scan(files, weight_map))
    if sharding is not None:
        _shard_plan(plan, sharding)
    problems = _check(plan, _as_dequantized(expected, packed))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model:\n  " + "\n  ".join(problems))
    reporter = _Progress(files, progress)
    if plan.skipped_mtp:
        reporter.emit(
            f"skipping {plan.skipped_mtp} multi-token-prediction (mtp.*) tensors: "
            "v4serve does not load the MTP block yet"
        )
    int_dtypes = {n: spec[1] for n, spec in expected.items() if spec[1] is not None and not spec[1].is_floating_point}
    for name, tensor in _read_all(plan, files, dtype, int_dtypes, packed, reporter):
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != tuple(want[0]):
            raise CheckpointError(f"{name}: the model expects {list(want[0])}, the checkpoint gives "
                                  f"{list(tensor.shape)}")
        yield name, tensor


def _shard_plan(plan: _Plan, sharding: Sharding) -> None:
    """Keep only the tensors a rank holds, each with the slice of it the rank holds."""
    units = []
    for unit in plan.units:
        unit.outputs = [(name, rows) for name, rows in unit.outputs if sharding.holds(name)]
        for name, rows in unit.outputs:
            part = sharding.slice_of(name, unit.output_shape(rows))
            if part is not None:
                unit.parts[name] = part
        if unit.outputs:
            units.append(unit)
    plan.units = units
    plan.sources = {name: unit for name, unit in plan.sources.items() if sharding.holds(name)}


def _as_dequantized(expected: Mapping[str, tuple[Any, torch.dtype]], packed: Mapping[str, PackedFormat]
                    ) -> dict[str, tuple[Any, torch.dtype]]:
    """`expected` as the plan checks it: packed weights by their logical shape, scales left out
    (the plan pairs every weight with its scale itself)."""
    out = {}
    for name, (shape, dtype) in expected.items():
        if name.endswith(".scale") and name.removesuffix(".scale") + ".weight" in packed:
            continue
        if name in packed:
            n, k = shape
            out[name] = ((n, 2 * k if packed[name].fmt == "fp4" else k), torch.float32)
        else:
            out[name] = (shape, dtype)
    return out


def _read_all(
    plan: _Plan,
    files: Sequence[Path],
    dtype: torch.dtype,
    int_dtypes: dict[str, torch.dtype],
    packed: Mapping[str, PackedFormat],
    reporter: _Progress,
) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[_Unit]] = {f: [] for f in files}
    for unit in plan.units:
        by_file[unit.weight.file].append(unit)
    handles = _Handles()
    for shard_no, file in enumerate(files, start=1):
        units = by_file[file]
        for count, unit in enumerate(units, start=1):
            yield from _materialize(unit, handles, dtype, int_dtypes, packed)
            share = unit.weight.nbytes // (unit.weight.shape[0] if unit.expert is not None else 1)
            reporter.tensor(shard_no, file, count, len(units), share)
        reporter.shard(shard_no, file, len(units))


# ---------------------------------------------------------------------------------------------
# Headers only (the capacity plan)


@dataclass(frozen=True)
class HeaderScan:
    """What a checkpoint folder holds, from its safetensors headers alone. `tensors` has one entry
    per official tensor the loader would produce: (official name, logical shape (FP4 unpacked, one
    expert of a merged tensor, its w1/w3 half), stored dtype, scale dtype or None)."""

    tensors: tuple[tuple[str, tuple[int, ...], str, str | None], ...]
    mtp_tensors: int  # multi-token-prediction tensors (scales included), which the loader skips
    mtp_bytes: int


def scan_headers(path: str | Path) -> HeaderScan:
    """Every tensor of a checkpoint as `load_checkpoint` would read it, without reading tensor data.
    Raises CheckpointError for what the loader would refuse before reading (unpaired FP8 tensors,
    duplicates, unreadable headers)."""
    files, weight_map = _shard_files(Path(path))
    stored = _scan(files, weight_map)
    plan = _plan(stored)
    if plan.problems:
        raise CheckpointError(f"checkpoint {path} cannot be loaded:\n  " + "\n  ".join(plan.problems))
    tensors = tuple(
        (name, unit.output_shape(rows), unit.weight.dtype, unit.scale.dtype if unit.scale else None)
        for unit in plan.units
        for name, rows in unit.outputs
    )
    mtp = [entry for key, entry in stored.items() if key.removeprefix("model.").startswith("mtp.")]  # as _plan
    return HeaderScan(tensors, len(mtp), sum(entry.nbytes for entry in mtp))
