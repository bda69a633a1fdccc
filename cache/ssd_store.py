"""The SSD prefix store: sealed blocks (and state snapshots) as files, named by chain hash.

Plain Python, no torch: payloads are bytes, produced and consumed by `device_kv.DeviceKV`. All
file I/O runs on the store's own threads (one writer, reader pools), never on the engine step or
the HTTP event loop.

Layout: `<root>/<namespace>/<h[:2]>/<h[2:4]>/<h>.blk` (a block) and `.snap` (the State Cache
slot state at the end of that block). Each file is a header — magic, format version, kind,
namespace digest, chain hash, the block's token ids (so a hash collision is a miss, never wrong
tokens), a layout descriptor, payload length, CRC32 of everything — then the payload.

Writes happen on a background thread: temp file in the same folder, then rename, never
rewriting a present file. A bad file (truncated, checksum, wrong namespace, wrong tokens,
unreadable) is a miss: it is moved to `<root>/quarantine/` and counted. A full disk stops
writing, not serving. Several daemons may share a folder: files are immutable once renamed,
each daemon keeps its own index and treats a vanished file as a miss.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import queue
import struct
import threading
import time
import uuid
import zlib
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"V4KVSTOR"
FORMAT_VERSION = 1
KIND_BLOCK, KIND_SNAPSHOT = 1, 2
SUFFIX = {KIND_BLOCK: ".blk", KIND_SNAPSHOT: ".snap"}
# magic, version, kind, namespace, hash, token count, layout length, payload length
_HEAD = struct.Struct("<8sHB32s32sIIQ")
_CRC = struct.Struct("<I")
ERROR_KINDS = ("truncated", "checksum", "namespace", "collision", "format", "unreadable", "enospc", "write")


class StoreFileError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class StoreEntry:
    path: Path
    size: int


def encode(kind: int, namespace: bytes, block_hash: bytes, tokens: Sequence[int], layout: bytes,
           payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The file's pieces in order (header, token ids, layout, payload parts, CRC)."""
    length = sum(len(p) for p in payload)
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, kind, namespace, block_hash, len(tokens), len(layout), length)
    token_bytes = struct.pack(f"<{len(tokens)}i", *tokens)
    crc = 0
    for part in (head, token_bytes, layout, *payload):
        crc = zlib.crc32(part, crc)
    return [head, token_bytes, layout, *payload, _CRC.pack(crc)]


def decode(data: bytes | bytearray, namespace: bytes, block_hash: bytes, tokens: Sequence[int] | None,
           layout: bytes) -> memoryview:
    """Check a whole file's bytes and return its payload; raises StoreFileError naming the fault."""
    if len(data) < _HEAD.size + _CRC.size:
        raise StoreFileError("truncated", f"{len(data)} bytes is shorter than a header")
    magic, version, _, ns, h, n_tok, n_layout, n_payload = _HEAD.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise StoreFileError("format", f"not a v4serve store file (magic {magic!r}, version {version})")
    body = _HEAD.size + 4 * n_tok + n_layout + n_payload
    if len(data) != body + _CRC.size:
        kind = "truncated" if len(data) < body + _CRC.size else "format"
        raise StoreFileError(kind, f"{len(data)} bytes, header says {body + _CRC.size}")
    if zlib.crc32(memoryview(data)[:body]) != _CRC.unpack_from(data, body)[0]:
        raise StoreFileError("checksum", "checksum mismatch")
    if ns != namespace:
        raise StoreFileError("namespace", "written for another model, KV dtype or layout")
    if h != block_hash:
        raise StoreFileError("collision", "the file holds another hash")
    stored_tokens = struct.unpack_from(f"<{n_tok}i", data, _HEAD.size)
    if tokens is not None and tuple(stored_tokens) != tuple(tokens):
        raise StoreFileError("collision", "same hash, different tokens")
    offset = _HEAD.size + 4 * n_tok
    if bytes(data[offset:offset + n_layout]) != layout:
        raise StoreFileError("namespace", "another KV layout")
    return memoryview(data)[offset + n_layout:body]


@dataclass
class StoreStats:
    """Cumulative counters. The store's threads change them under its lock; readers on other
    threads take `SSDStore.stats_snapshot()`."""

    bytes_read: int = 0
    bytes_written: int = 0
    files_written: int = 0
    errors: Counter = field(default_factory=Counter)


class SSDStore:
    def __init__(self, root: str | Path, namespace: bytes, layout: bytes, max_bytes: int | None = None,
                 readers: int = 2, io_threads: int = 4) -> None:
        self.root = Path(root)
        self.namespace, self.layout, self.max_bytes = namespace, layout, max_bytes
        self.dir = self.root / namespace.hex()[:32]
        self.quarantine = self.root / "quarantine"
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[int, bytes], StoreEntry] = OrderedDict()  # LRU order
        self._writes: queue.Queue[tuple | None] = queue.Queue(maxsize=4096)
        self._writing_disabled = False
        self.used_bytes = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="v4serve-ssd-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="v4serve-ssd-reader")
        # Several reads in flight: an SSD serves small files faster in parallel than one by one.
        self._io = ThreadPoolExecutor(io_threads, thread_name_prefix="v4serve-ssd-io")
        self._io_threads = io_threads

    # ---- index ----------------------------------------------------------------------------------
    def path(self, kind: int, block_hash: bytes) -> Path:
        h = block_hash.hex()
        return self.dir / h[:2] / h[2:4] / (h + SUFFIX[kind])

    def _scan(self) -> None:
        """Rebuild the index from the files present (oldest first), removing leftover temp files."""
        found = []
        for dirpath, _, names in os.walk(self.dir):
            for name in names:
                path = Path(dirpath) / name
                if name.startswith(".tmp-"):
                    with contextlib.suppress(OSError):
                        path.unlink()
                    continue
                kind = next((k for k, s in SUFFIX.items() if name.endswith(s)), None)
                if kind is None:
                    continue
                with contextlib.suppress(OSError):
                    st = path.stat()
                    found.append((st.st_mtime, kind, bytes.fromhex(name[: -len(SUFFIX[kind])]), path, st.st_size))
        for _, kind, h, path, size in sorted(found):
            self._index[(kind, h)] = StoreEntry(path, size)
            self.used_bytes += size
        if found:
            log.info("SSD store %s: %d files, %.1f MiB", self.dir, len(found), self.used_bytes / 2**20)

    def contains(self, kind: int, block_hash: bytes) -> bool:
        key = (kind, block_hash)
        with self._lock:
            if key in self._index:
                return True
        path = self.path(kind, block_hash)
        try:
            size = path.stat().st_size  # written by another daemon sharing the folder
        except OSError:
            return False
        with self._lock:
            if key not in self._index:
                self._index[key] = StoreEntry(path, size)
                self.used_bytes += size
        return True

    def longest_prefix(self, hashes: Sequence[bytes]) -> int:
        n = 0
        for h in hashes:
            if not self.contains(KIND_BLOCK, h):
                break
            n += 1
        return n

    # ---- writing ----------------------------------------------------------------------------------
    def put(self, kind: int, block_hash: bytes, tokens: Sequence[int], payload: Sequence[bytes | memoryview]) -> bool:
        """Queue a file for the background writer; False if writing is off or the queue is full."""
        if self._writing_disabled or self.contains(kind, block_hash):
            return False
        try:
            self._writes.put_nowait((kind, block_hash, tuple(tokens), payload))
        except queue.Full:
            return False
        return True

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _write_loop(self) -> None:
        while True:
            item = self._writes.get()
            try:
                if item is None:
                    return
                self._write(*item)
            except Exception:  # a writer must never die: count and go on
                log.exception("SSD store write failed")
                self._count_error("write")
            finally:
                self._writes.task_done()

    def _write(self, kind: int, block_hash: bytes, tokens: tuple[int, ...], payload: Sequence[bytes]) -> None:
        if self._writing_disabled:
            return
        path = self.path(kind, block_hash)
        if path.exists():
            self.contains(kind, block_hash)
            return
        parts = encode(kind, self.namespace, block_hash, tokens, self.layout, payload)
        size = sum(len(p) for p in parts)
        tmp = path.parent / f".tmp-{uuid.uuid4().hex}"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(tmp, "wb") as f:
                for part in parts:
                    f.write(part)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                self._writing_disabled = True
                self._count_error("enospc")
                log.error("SSD store %s is full: writing stops, serving goes on", self.root)
            else:
                self._count_error("write")
                log.warning("SSD store write of %s failed: %s", path.name, exc)
            return
        with self._lock:
            self._index[(kind, block_hash)] = StoreEntry(path, size)
            self.used_bytes += size
            self.stats.bytes_written += size
            self.stats.files_written += 1
        self._evict()

    def _evict(self) -> None:
        if self.max_bytes is None:
            return
        while True:
            with self._lock:
                if self.used_bytes <= self.max_bytes or not self._index:
                    return
                _, entry = self._index.popitem(last=False)
                self.used_bytes -= entry.size
            with contextlib.suppress(OSError):
                entry.path.unlink()

    @property
    def writing(self) -> bool:
        return not self._writing_disabled

    # ---- reading ----------------------------------------------------------------------------------
    def get(self, kind: int, block_hash: bytes, tokens: Sequence[int] | None) -> memoryview | None:
        """A file's payload, or None (a miss) if absent or bad; bad files are quarantined."""
        key = (kind, block_hash)
        path = self.path(kind, block_hash)
        try:
            with open(path, "rb") as f:
                # A writable buffer: payload tensors are built on it without another copy.
                data = bytearray(os.fstat(f.fileno()).st_size)
                data = data[: f.readinto(data)]
        except FileNotFoundError:
            self._forget(key)
            return None
        except OSError as exc:
            self._bad(key, path, StoreFileError("unreadable", str(exc)))
            return None
        try:
            payload = decode(data, self.namespace, block_hash, tokens, self.layout)
        except StoreFileError as exc:
            self._bad(key, path, exc)
            return None
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.stats.bytes_read += len(data)
        return payload

    def get_many(self, kind: int, items: Sequence[tuple[bytes, Sequence[int] | None]]) -> list[memoryview]:
        """Payloads of consecutive files, up to the first miss; a few runs of files are read in
        parallel (an SSD serves several small reads at once faster than one by one)."""
        size = -(-len(items) // self._io_threads) if items else 1
        runs = [items[i:i + size] for i in range(0, len(items), size)]

        def read_run(run: Sequence[tuple[bytes, Sequence[int] | None]]) -> list[memoryview | None]:
            return [self.get(kind, h, tokens) for h, tokens in run]

        out: list[memoryview] = []
        for payloads in self._io.map(read_run, runs):
            for payload in payloads:
                if payload is None:
                    return out
                out.append(payload)
        return out

    def submit_io(self, fn: Callable[[], object]) -> Future:
        """Run one more read alongside the others (on the IO pool)."""
        return self._io.submit(fn)

    def submit(self, fn: Callable[[], object]) -> Future:
        """Run a load on the reader pool (never on the engine step)."""
        return self._readers.submit(fn)

    def _forget(self, key: tuple[int, bytes]) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.size

    def _count_error(self, kind: str) -> None:
        with self._lock:
            self.stats.errors[kind] += 1

    def stats_snapshot(self) -> StoreStats:
        """A consistent copy of the counters, safe to hand to another thread."""
        with self._lock:
            return StoreStats(self.stats.bytes_read, self.stats.bytes_written, self.stats.files_written,
                              Counter(self.stats.errors))

    def _bad(self, key: tuple[int, bytes], path: Path, exc: StoreFileError) -> None:
        self._count_error(exc.kind)
        log.warning("SSD store file %s is bad (%s: %s): treated as a miss and quarantined", path.name, exc.kind, exc)
        self._forget(key)
        with contextlib.suppress(OSError):
            self.quarantine.mkdir(parents=True, exist_ok=True)
            os.replace(path, self.quarantine / f"{path.name}.{exc.kind}.{uuid.uuid4().hex[:8]}")

    # ---- admin ------------------------------------------------------------------------------------
    def clear(self) -> int:
        """Delete every file of this namespace (reset_prefix_cache with the store)."""
        self.flush()
        with self._lock:
            entries = list(self._index.values())
            self._index.clear()
            self.used_bytes = 0
        for entry in entries:
            with contextlib.suppress(OSError):
                entry.path.unlink()
        return len(entries)

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join(timeout=10)
        self._readers.shutdown(wait=True)
        self._io.shutdown(wait=True)

