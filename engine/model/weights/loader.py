"""Checkpoint loading: safetensors folders -> tensors keyed by DeepSeek-V4's official names, read one
at a time and placed as the model holds them.

The loader is three modules: files.py finds the files and reads their headers,
layout.py maps the accepted spellings onto the official names and plans and checks the
reads, and this one reads the tensor data. Every header is read and checked before any tensor data
is; tensors are then read one by one (merged experts one expert slab at a time) and dequantized as
they come, or kept packed (codes and scales as stored) where the model holds them so, keeping peak
memory close to the size of the result.

Under tensor or expert parallelism (engine/model/parallel/sharding.py) a rank passes its `Sharding`: only the
tensors it holds are read, each through safetensors' `get_slice`, so a rank reads its rows or
columns and never a whole split tensor. Quantized weights are sliced as stored (codes with the
scales that cover them), so they can stay packed.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from v4serve.engine.model.weights.files import (
    PACKED_FP4_DTYPES,
    CheckpointError,
    Handles,
    fp8_tile,
    read_headers,
    shard_files,
)
from v4serve.engine.model.weights.layout import Plan, Sharding, Unit, check_plan, plan_units, scale_name
from v4serve.engine.model.weights.packed import PackedFormat
from v4serve.engine.model.weights.quant import FP4_GROUP, FP8_BLOCK, dequant_fp4_packed, dequant_fp8_block
from v4serve.engine.model.weights.resident import held_in_fp32

# Progress goes to this module's logger, the one a user would look for when a load seems slow.
log = logging.getLogger(__name__)

_HEARTBEAT_S = 10.0


# ---------------------------------------------------------------------------------------------
# Reading


def _materialize(
    unit: Unit, handles: Handles, dtype: torch.dtype, own_dtypes: dict[str, torch.dtype],
    packed: Mapping[str, PackedFormat],
) -> list[tuple[str, torch.Tensor]]:
    if unit.parts:
        return _sliced_outputs(unit, handles, dtype, own_dtypes, packed)
    tensor = handles.read(unit.weight, unit.expert)
    if unit.scale is not None and unit.outputs[0][0] in packed:
        return _packed_outputs(unit, tensor, handles.read(unit.scale, unit.expert), packed)
    if unit.scale is not None:
        scale = handles.read(unit.scale, unit.expert)
        try:
            if unit.quant == "fp8":
                tensor = dequant_fp8_block(tensor, scale, unit.tile, dtype)
            else:
                tensor = dequant_fp4_packed(tensor, scale, FP4_GROUP, dtype)
        except ValueError as err:
            raise CheckpointError(f"cannot dequantize {unit.weight.where()}: {err}") from err
    out = []
    for name, rows in unit.outputs:
        want = own_dtypes.get(name, dtype)
        if rows is None:
            out.append((name, tensor.to(want)))
        else:
            # A copy, so w1 and w3 do not share storage (which would trip anyone saving them).
            out.append((name, tensor[rows].to(want, copy=True)))
    return out


def _sliced_outputs(
    unit: Unit, handles: Handles, dtype: torch.dtype, own_dtypes: dict[str, torch.dtype],
    packed: Mapping[str, PackedFormat],
) -> list[tuple[str, torch.Tensor]]:
    """A rank's outputs of one unit, each read on its own: its region of the codes, and of the scales
    the region's whole blocks (layout's `_check_part` made sure it holds whole ones), as the unsliced path
    would give them for a tensor of that shape."""
    out = []
    for name, rows in unit.outputs:
        region = unit.region(rows, unit.parts.get(name))
        tensor = handles.read_region(unit.weight, unit.expert, _stored_region(unit, region))
        if unit.scale is None:
            out.append((name, tensor.to(own_dtypes.get(name, dtype))))
            continue
        scale = handles.read_region(unit.scale, unit.expert, _scale_region(unit, region))
        if name in packed:
            codes, scale = _as_resident(tensor, scale)
            out += [(name, codes), (scale_name(name), scale)]
        elif unit.quant == "fp8":
            out.append((name, dequant_fp8_block(tensor, scale, unit.tile, dtype)))
        else:
            out.append((name, dequant_fp4_packed(tensor, scale, FP4_GROUP, dtype)))
    return out


def _stored_region(unit: Unit, region: tuple[slice, ...]) -> tuple[slice, ...]:
    """Logical indices → stored ones: packed FP4 holds two columns per byte."""
    if unit.quant != "fp4" or unit.weight.dtype not in PACKED_FP4_DTYPES:
        return region
    cols = region[-1]
    return (*region[:-1], slice(cols.start // 2, -(-cols.stop // 2)))


def _scale_region(unit: Unit, region: tuple[slice, ...]) -> tuple[slice, ...]:
    """The scales covering a region: FP8 one per tile (V4: 128x128), FP4 one per 32 columns of a row."""
    def blocks(span: slice, size: int) -> slice:
        return slice(span.start // size, -(-span.stop // size))

    if unit.quant == "fp8":
        return (*region[:-2], blocks(region[-2], unit.tile[0]), blocks(region[-1], unit.tile[1]))
    return (*region[:-1], blocks(region[-1], FP4_GROUP))


def _as_resident(codes: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and scales as a packed layer holds them: bytes, fp32 scales as int32 bits (see
    engine/model/weights/packed.py)."""
    codes = codes.contiguous().view(torch.uint8)
    if scale.dtype == getattr(torch, "float8_e8m0fnu", None):
        scale = scale.view(torch.uint8)
    elif scale.dtype != torch.uint8:
        scale = scale.to(torch.float32).view(torch.int32)
    return codes, scale


def _packed_outputs(unit: Unit, codes: torch.Tensor, scale: torch.Tensor, packed: Mapping[str, PackedFormat]
                    ) -> list[tuple[str, torch.Tensor]]:
    """Codes and scales as stored (bytes; fp32 scales as int32 bits: see engine/model/weights/packed.py),
    split by rows where a merged tensor holds two weights."""
    codes, scale = _as_resident(codes, scale)
    out = []
    for name, rows in unit.outputs:
        if rows is None:
            out += [(name, codes), (scale_name(name), scale)]
            continue
        block = FP8_BLOCK[0] if packed[name].fmt == "fp8" else 1
        scale_rows = slice(rows.start // block, -(-rows.stop // block))
        out += [(name, codes[rows].clone()), (scale_name(name), scale[scale_rows].clone())]
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
    skip: Mapping[str, str] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(official name, tensor) for every tensor of `expected`, read one at a time, so the caller can
    put each on its device before the next is read (no whole-model copy in host memory).

    `expected` maps every official name the model needs to (shape, dtype). Floating tensors, FP8 and
    FP4 ones dequantized, come back as `dtype`, but for those `resident.held_in_fp32` names, which come
    back in their expected dtype, as do integer tensors (`ffn.gate.tid2eid`). Weights named in
    `packed` (see `layout.packed_formats`) come back as stored instead: their codes as
    bytes, then `NAME.scale` (e8m0 bytes, or fp32 scales as int32 bits). Multi-token-prediction
    tensors (`mtp.*`) are read when `expected` names them, else skipped. Raises CheckpointError
    naming the offending tensors, before any tensor data is read, when the checkpoint does not match.
    `sharding`: one rank's part (module docstring); `expected` then holds that rank's shapes. `skip`: name
    prefixes the model does not load, each with the reason the log gives.
    """
    path = Path(path)
    packed = dict(packed or {})
    files, weight_map = shard_files(path)
    mtp = any(name.startswith("mtp.") for name in expected)
    plan = plan_units(read_headers(files, weight_map), mtp, fp8_tile(path, FP8_BLOCK), skip)
    if mtp and not any(name.startswith("mtp.") for name in plan.sources):
        raise CheckpointError(f"checkpoint {path} holds no multi-token-prediction tensors (mtp.*), though its "
                              "config names an MTP layer (transformers leaves them out when it saves a model): "
                              "speculative method 'mtp' needs the original checkpoint's files")
    if sharding is not None:
        _shard_plan(plan, sharding)
    problems = check_plan(plan, _as_dequantized(expected, packed))
    if problems:
        raise CheckpointError(f"checkpoint {path} does not match the model:\n  " + "\n  ".join(problems))
    reporter = _Progress(files, progress)
    for reason, count in plan.skipped.items():
        reporter.emit(f"skipping {count} tensors: {reason}")
    if plan.skipped_mtp:
        reporter.emit(
            f"skipping {plan.skipped_mtp} multi-token-prediction (mtp.*) tensors: "
            "speculative decoding with method 'mtp' uses them (--speculative-config)"
        )
    # Integer tensors, and the parameters the model may hold in fp32 whatever `dtype` (held_in_fp32).
    own_dtypes = {n: spec[1] for n, spec in expected.items()
                  if spec[1] is not None and (not spec[1].is_floating_point or held_in_fp32(n))}
    for name, tensor in _read_all(plan, files, dtype, own_dtypes, packed, reporter):
        want = expected.get(name)
        if want is not None and tuple(tensor.shape) != tuple(want[0]):
            raise CheckpointError(f"{name}: the model expects {list(want[0])}, the checkpoint gives "
                                  f"{list(tensor.shape)}")
        yield name, tensor


def _shard_plan(plan: Plan, sharding: Sharding) -> None:
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
    plan: Plan,
    files: Sequence[Path],
    dtype: torch.dtype,
    own_dtypes: dict[str, torch.dtype],
    packed: Mapping[str, PackedFormat],
    reporter: _Progress,
) -> Iterator[tuple[str, torch.Tensor]]:
    by_file: dict[Path, list[Unit]] = {f: [] for f in files}
    for unit in plan.units:
        by_file[unit.weight.file].append(unit)
    handles = Handles()
    for shard_no, file in enumerate(files, start=1):
        units = by_file[file]
        for count, unit in enumerate(units, start=1):
            yield from _materialize(unit, handles, dtype, own_dtypes, packed)
            share = unit.weight.nbytes // (unit.weight.shape[0] if unit.expert is not None else 1)
            reporter.tensor(shard_no, file, count, len(units), share)
        reporter.shard(shard_no, file, len(units))
