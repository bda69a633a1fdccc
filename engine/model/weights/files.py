"""Checkpoint files: which safetensors files make up a checkpoint, what their headers hold, its config.json.

A checkpoint is a folder holding an index (`model.safetensors.index.json`) and the shards it names, a
single `model.safetensors`, or any `*.safetensors`; or one safetensors file. Only headers (names, dtypes,
shapes) are read here, so that layout.py can check the whole checkpoint against the model
before any tensor data is read; loader.py then reads the data through `Handles`.

This is the bottom of the loader's three modules (this one, layout.py, loader.py): the error
they all raise and the safetensors dtype tables they all consult live here, so nothing here imports
the other two.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
_LIST_LIMIT = 10

FP8_DTYPES = {"F8_E4M3", "F8_E5M2"}
PACKED_FP4_DTYPES = {"I8", "U8"}  # two codes per byte: the header holds the packed shape
FP4_DTYPES = {"F4"}  # float4_e2m1fn_x2: the header already holds the logical shape
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
INT_DTYPES = {"I64", "I32", "I16", "I8", "U64", "U32", "U16", "U8", "BOOL"}
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


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded as the expected model; the message names the tensors."""


@dataclass(frozen=True)
class Stored:
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


def fp8_tile(path: str | Path, default: tuple[int, int]) -> tuple[int, int]:
    """The FP8 scale tile a checkpoint declares (config.json's `quantization_config.weight_block_size`:
    V4 128x128, V4.1 32x32), or `default` where it declares none (or `path` is a bare file)."""
    path = Path(path)
    file = path / CONFIG_FILE if path.is_dir() else path.parent / CONFIG_FILE
    if not file.is_file():
        return default
    block = read_config_json(file).get("quantization_config", {}).get("weight_block_size")
    if block is None:
        return default
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise CheckpointError(f"{file}: quantization_config.weight_block_size must be two positive integers, "
                              f"found {block!r}")
    return block[0], block[1]


def shard_files(path: Path) -> tuple[list[Path], dict[str, str] | None]:
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
                f"{short_list(missing)} (e.g. {missing[0]} should hold {short_list(users, 3)})"
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


def read_headers(files: Sequence[Path], weight_map: Mapping[str, str] | None) -> dict[str, Stored]:
    """Every tensor's header entry; no tensor data is read."""
    stored: dict[str, Stored] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                for key in handle.keys():
                    sl = handle.get_slice(key)
                    if key in stored:
                        raise CheckpointError(f"tensor '{key}' appears in both {stored[key].file.name} and {file.name}")
                    stored[key] = Stored(file, key, sl.get_dtype(), tuple(sl.get_shape()))
        except CheckpointError:
            raise
        except Exception as err:  # safetensors raises its own error types for corrupt headers
            raise CheckpointError(f"cannot read safetensors header of {file}: {err}") from err
    if weight_map is not None:
        absent = [k for k, shard in weight_map.items() if k not in stored]
        if absent:
            raise CheckpointError(
                f"{INDEX_FILE} lists {len(absent)} tensor(s) its shards do not hold: "
                f"{short_list([f'{k} (in {weight_map[k]})' for k in absent])}"
            )
    return stored


class Handles:
    """Open safetensors files, kept open for the whole load (a scale may sit in another shard)."""

    def __init__(self) -> None:
        self._open: dict[Path, Any] = {}
        self._whole: tuple[Stored, torch.Tensor] | None = None

    def _handle(self, entry: Stored) -> Any:
        handle = self._open.get(entry.file)
        if handle is None:
            handle = self._open[entry.file] = safe_open(entry.file, framework="pt")
        return handle

    def read(self, entry: Stored, expert: int | None = None) -> torch.Tensor:
        handle = self._handle(entry)
        if expert is None:
            return handle.get_tensor(entry.key)
        # Slicing one expert out of a merged tensor avoids materialising all experts at once.
        if entry.dtype not in FP4_DTYPES:
            return handle.get_slice(entry.key)[expert]
        # safetensors cannot slice float4 storage: read it whole once and serve every expert from it.
        if self._whole is None or self._whole[0] != entry:
            self._whole = (entry, handle.get_tensor(entry.key))
        return self._whole[1][expert]

    def read_region(self, entry: Stored, expert: int | None, region: tuple[slice, ...]) -> torch.Tensor:
        """Part of a stored tensor (of one expert), in stored indices: only these bytes are read."""
        return self._handle(entry).get_slice(entry.key)[region if expert is None else (expert, *region)]


def short_list(items: Iterable[str], limit: int = _LIST_LIMIT, sep: str = ", ", lead: str = "") -> str:
    """At most `limit` items, then how many more: a message about 10,000 tensors stays readable."""
    items = list(items)
    shown = lead + sep.join(items[:limit])
    return shown if len(items) <= limit else f"{shown}{sep}... ({len(items) - limit} more)"


# ---------------------------------------------------------------------------------------------
# Writing (make-checkpoint, tests)


def save_checkpoint_files(folder: Path, config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor],
                          max_shard_bytes: int | None = None) -> Path:
    """config.json and the tensors as safetensors: one `model.safetensors`, or shards of at most
    `max_shard_bytes` with their index."""
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
    shards = _shard(tensors, max_shard_bytes)
    if len(shards) == 1:
        _save(shards[0], folder / SINGLE_FILE)
        return folder
    weight_map = {}
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _save(shard, folder / name)
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    return folder


def _save(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors writes its files readable by their owner alone; a checkpoint gets the mode any other
    file would (the umask's), so a container's user can read one made on its host."""
    save_file(tensors, path, metadata={"format": "pt"})
    umask = os.umask(0)
    os.umask(umask)
    path.chmod(0o666 & ~umask)


def _shard(tensors: Mapping[str, torch.Tensor], limit: int | None) -> list[dict[str, torch.Tensor]]:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if limit and shards[-1] and size + nbytes > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards
