"""Content digests of a model's weights. They name the SSD store's namespace, so KV written under
other weights is never read: every byte counts, and a fine-tune that changes one row of one tensor
changes the digest.

A checkpoint folder is digested from its files (config.json and every *.safetensors file), each
file's digest cached by name, size and modification time, so a restart costs a stat per file; a
model without files (the embedded tiny one) from its tensors.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

import torch

log = logging.getLogger(__name__)

_CHUNK = 16 << 20


def tensors_digest(tensors: Iterable[tuple[str, torch.Tensor]]) -> bytes:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    h = hashlib.sha256()
    for name, t in sorted(tensors, key=lambda item: item[0]):
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\0".encode())
        h.update(t.detach().contiguous().cpu().view(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()


def checkpoint_digest(folder: str | Path, cache_file: str | Path | None = None) -> bytes:
    """sha256 over the digests of config.json and every *.safetensors file of a checkpoint folder."""
    folder = Path(folder)
    files = sorted([folder / "config.json", *folder.glob("*.safetensors")], key=lambda p: p.name)
    cache = _read_cache(cache_file)
    h = hashlib.sha256()
    for path in files:
        st = path.stat()
        key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}"
        digest = cache.get(key)
        if digest is None:
            digest = cache[key] = _file_digest(path, st.st_size)
        h.update(f"{path.name}\0{digest}\0".encode())
    _write_cache(cache_file, cache)
    return h.digest()


def _file_digest(path: Path, size: int) -> str:
    t0, h, done, last_log = time.monotonic(), hashlib.sha256(), 0, time.monotonic()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            done += len(chunk)
            if time.monotonic() - last_log > 10:  # large shards take a while: say how far along
                last_log = time.monotonic()
                log.info("digesting %s for the SSD store namespace: %.0f%%", path.name, 100 * done / max(size, 1))
    if size > 1 << 30:
        log.info("digested %s (%.1f GB) in %.0f s", path.name, size / 1e9, time.monotonic() - t0)
    return h.hexdigest()


def _read_cache(cache_file: str | Path | None) -> dict[str, str]:
    if cache_file is None:
        return {}
    try:
        data = json.loads(Path(cache_file).read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def _write_cache(cache_file: str | Path | None, cache: dict[str, str]) -> None:
    if cache_file is None:
        return
    path = Path(cache_file)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{time.monotonic_ns()}")
        tmp.write_text(json.dumps(cache, indent=0, sort_keys=True))
        tmp.replace(path)
    except OSError as exc:  # only a cache: the next start hashes again
        log.warning("could not save weight digests to %s: %s", path, exc)
