"""The SSD prefix store: sealed blocks (and state snapshots) as files, named by chain hash, that is
never allowed to serve a wrong byte.

Plain Python, no torch: payloads are bytes, produced and consumed by `device_kv.DeviceKV`. All
file I/O runs on the store's own threads (one writer, loaders) or its reader process (`ssd_reader`:
a hit's block files are read and checked there, so their per-file Python work never takes this
process's interpreter from the engine loop), never on the engine step or the HTTP event loop. The
file format and its checks are in `ssd_file`.

Layout: `<root>/<namespace>/<h[:2]>/<h[2:4]>/<h>.blk` (a block) and `.snap` (the State Cache slot
state at the end of that block); `<root>/quarantine/` holds bad files (bounded); `<root>/handover/<id>/`
holds a prefill replica's hand-over to a decode replica (links to its files and a manifest, kept
until fetched or `hold_seconds` old).

- Writes: on a background thread, through a temp file named after its writer (host and pid) and
  a rename; a present file is never rewritten. A full disk stops writing, not serving, and writing
  resumes once space is back (checked every `retry_seconds`).
- Reads: a bad file (truncated, checksum, another kind, namespace, layout or payload length,
  colliding tokens, unreadable, not a regular file) is a miss, moved to quarantine and counted; a
  read that does not return within `read_timeout` is a miss too (its daemon thread is abandoned, or
  its reader process ended and replaced, so it can block neither a request nor shutdown); so is
  whatever a reader process that died had not yet reported.
- Sharing: several daemons may use one folder. Files are immutable once renamed; each daemon keeps
  its own index and treats a vanished file as a miss; a starting store removes only temp files
  whose writer is gone (or that are older than `STALE_TEMP_SECONDS`).
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import queue
import shutil
import threading
import time
import uuid
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

from v4serve.cache.block_pool import chain_hash
from v4serve.cache.kv_events import DISK, KVEventLog
from v4serve.cache.ssd_file import (
    FOOTER_BYTES,
    HEADER_BYTES,
    KIND_BLOCK,
    KIND_RESPONSE,
    SUFFIX,
    StoreFileError,
    decode,
    encode,
    file_tokens,
    pack_tokens,
    read_store_file,
    temp_is_stale,
    temp_name,
    will_need,
)
from v4serve.cache.ssd_reader import (
    MISSING,
    OK,
    FileRequest,
    NoSharedMemory,
    Outcome,
    ReaderGone,
    ReaderProcess,
    copy_rows_without_the_gil,
    sweep_shm_leftovers,
)

log = logging.getLogger(__name__)
T = TypeVar("T")

STALE_TEMP_SECONDS = 3600.0  # a temp file this old has no live writer, whoever wrote it
HANDOVER_DIR, MANIFEST = "handover", "manifest.json"
SWEEP_SECONDS = 5.0  # hand-overs past their hold are looked for at least this often
MAX_QUARANTINE_FILES = 256  # the oldest quarantined files go beyond this
Item = tuple[bytes, Sequence[int] | None]  # (chain hash, the block's token ids or None)


@dataclass(frozen=True)
class StoreEntry:
    path: Path
    size: int
    parent: bytes | None = None  # response-end files: the sealed block they continue


@dataclass
class StoreStats:
    """Cumulative counters. The store's threads change them under its lock; readers on other
    threads take `SSDStore.stats_snapshot()`."""

    bytes_read: int = 0
    bytes_written: int = 0
    snapshot_bytes_written: int = 0  # of those, window-state snapshots (sealed and response ends)
    files_written: int = 0
    errors: Counter = field(default_factory=Counter)


def in_daemon_thread(fn: Callable[[], T]) -> Future:
    """Run fn on a fresh daemon thread: whatever it blocks on can never hold up the process's exit."""
    future: Future = Future()

    def run() -> None:
        if future.set_running_or_notify_cancel():
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits
                future.set_exception(exc)

    threading.Thread(target=run, name="v4serve-ssd-read", daemon=True).start()
    return future


class SSDStore:
    def __init__(self, root: str | Path, namespace: bytes, layout: bytes, payload_bytes: Mapping[int, int],
                 max_bytes: int | None = None, readers: int = 2, read_timeout: float = 10.0,
                 retry_seconds: float = 30.0, read_process: bool = True, read_reserve: int = 0) -> None:
        self.root = Path(root)
        self.namespace, self.layout, self.max_bytes = namespace, layout, max_bytes
        self.payload_bytes = dict(payload_bytes)  # exact payload length of each kind of file
        self.read_timeout, self.retry_seconds = read_timeout, retry_seconds
        self.dir = self.root / namespace.hex()[:32]
        self._dir_name = os.fspath(self.dir)
        self.quarantine = self.root / "quarantine"
        self.stats = StoreStats()
        self._lock = threading.Lock()
        self._index: OrderedDict[tuple[int, bytes], StoreEntry] = OrderedDict()  # LRU order
        self._responses: dict[bytes, dict[bytes, int]] = {}  # parent → {response-end key: tail length}
        self._writes: queue.Queue[tuple | Callable[[], None] | None] = queue.Queue(maxsize=4096)
        self._full_until: float | None = None  # while the disk is full: when to look for space again
        self._queued: set[tuple[int, bytes]] = set()  # (kind, key) of the writes waiting in `_writes`
        self._handover_hold: float | None = None  # a prefill replica's `hold_seconds` (`keep_handovers_for`)
        self._next_sweep = 0.0
        self.events: KVEventLog | None = None  # told of block files this daemon writes and removes (KV events)
        self.used_bytes = 0
        self.dir.mkdir(parents=True, exist_ok=True)
        self._scan()
        self.quarantined = self._count_quarantine()
        self._writer = threading.Thread(target=self._write_loop, name="v4serve-ssd-writer", daemon=True)
        self._writer.start()
        self._readers = ThreadPoolExecutor(readers, thread_name_prefix="v4serve-ssd-loader")
        # `get_many` reads in a child process (see `ssd_reader`); False reads on this process's threads,
        # which is what tests that inject faults into this process's reads select.
        self.reader = ReaderProcess(namespace, layout, self.payload_bytes) if read_process else None
        swept = sweep_shm_leftovers()  # crashed engines' reader memory (a reader keeps one while its store is open)
        if swept:
            log.info("SSD store: removed %d shared-memory files of engine processes that are gone", len(swept))
        if self.reader is not None:
            self.reader.start(read_reserve)  # `read_reserve`: bytes of payloads one read may take (see there)

    # ---- index ----------------------------------------------------------------------------------
    def path(self, kind: int, block_hash: bytes) -> Path:
        """Where a block or snapshot file lives (response-end files: `response_path`)."""
        h = block_hash.hex()
        return self.dir / h[:2] / h[2:4] / (h + SUFFIX[kind])

    def response_path(self, parent: bytes, tail_len: int, key: bytes) -> Path:
        """`resp/<parent>/<tail length>-<key>.resp`: a follow-up prompt finds the candidates that
        continue its sealed prefix by listing one folder."""
        p = parent.hex()
        return self.dir / "resp" / p[:2] / p / f"{tail_len}-{key.hex()}{SUFFIX[KIND_RESPONSE]}"

    def _file(self, kind: int, key: bytes) -> str | Path | None:
        """Where to read a file: a plain string for blocks and snapshots (a `Path` cost 45 us a file,
        more than reading it from the page cache)."""
        if kind != KIND_RESPONSE:
            h = key.hex()
            return f"{self._dir_name}/{h[:2]}/{h[2:4]}/{h}{SUFFIX[kind]}"
        with self._lock:
            entry = self._index.get((kind, key))
        return entry.path if entry is not None else None

    def responses(self, parent: bytes) -> dict[bytes, int]:
        """The response-end files continuing `parent`: {key: tail length}, including ones another
        daemon sharing the folder wrote since."""
        folder = self.response_path(parent, 0, b"").parent
        with contextlib.suppress(OSError):
            for name in os.listdir(folder):
                if name.endswith(SUFFIX[KIND_RESPONSE]):
                    with contextlib.suppress(OSError, ValueError):
                        self._add_response(folder / name, (folder / name).lstat().st_size)
        with self._lock:
            return dict(self._responses.get(parent, {}))

    def _add_response(self, path: Path, size: int) -> None:
        tail_len, key_hex = path.name.removesuffix(SUFFIX[KIND_RESPONSE]).split("-")
        parent, key = bytes.fromhex(path.parent.name), bytes.fromhex(key_hex)
        with self._lock:
            if (KIND_RESPONSE, key) not in self._index:
                self._index[(KIND_RESPONSE, key)] = StoreEntry(path, size, parent)
                self.used_bytes += size
            self._responses.setdefault(parent, {})[key] = int(tail_len)

    def _scan(self) -> None:
        """Rebuild the index from the files present (oldest first); remove leftover temp files."""
        found, stale = [], 0
        for dirpath, _, names in os.walk(self.dir):
            for name in names:
                path = Path(dirpath) / name
                with contextlib.suppress(OSError):
                    st = path.lstat()  # a link counts as its own few bytes, not its target's size
                    if name.startswith(".tmp-"):
                        if temp_is_stale(name, st.st_mtime, STALE_TEMP_SECONDS):
                            path.unlink()
                            stale += 1
                        continue
                    kind = next((k for k, s in SUFFIX.items() if name.endswith(s)), None)
                    if kind == KIND_RESPONSE:
                        found.append((st.st_mtime, kind, b"", path, st.st_size))
                    elif kind is not None:
                        found.append((st.st_mtime, kind, bytes.fromhex(name[: -len(SUFFIX[kind])]), path, st.st_size))
        for _, kind, h, path, size in sorted(found):
            if kind == KIND_RESPONSE:
                with contextlib.suppress(ValueError):
                    self._add_response(path, size)
                continue
            self._index[(kind, h)] = StoreEntry(path, size)
            self.used_bytes += size
        if found or stale:
            log.info("SSD store %s: %d files, %.1f MiB; %d leftover temp files removed", self.dir, len(found),
                     self.used_bytes / 2**20, stale)

    def contains(self, kind: int, block_hash: bytes) -> bool:
        key = (kind, block_hash)
        with self._lock:
            if key in self._index:
                return True
        if kind == KIND_RESPONSE:
            return False  # found through `responses(parent)`
        path = self.path(kind, block_hash)
        try:
            size = path.lstat().st_size  # written by another daemon sharing the folder (a link: its own size)
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
    @property
    def writing(self) -> bool:
        """False while the disk is full; true again once there is room for a few more files."""
        if self._full_until is None:
            return True
        if time.monotonic() < self._full_until:
            return False
        self._full_until = time.monotonic() + self.retry_seconds
        try:
            free = shutil.disk_usage(self.dir).free
        except OSError:
            return False
        if free < 4 * max(self.payload_bytes.values()):
            return False
        log.info("SSD store %s has room again (%.1f MiB free): writing resumes", self.root, free / 2**20)
        self._full_until = None
        return True

    def put(self, kind: int, block_hash: bytes, tokens: Sequence[int], payload: Sequence[bytes | memoryview],
            parent: bytes | None = None) -> bool:
        """Queue a file for the background writer (a response-end file names the `parent` it
        continues); False if writing is off or the queue is full."""
        if not self.writing:
            return False
        with self._lock:  # the index only: a file another daemon wrote is found by the writer thread
            if (kind, block_hash) in self._index:
                return False
            self._queued.add((kind, block_hash))  # before the writer can take it (and discard it)
        try:
            self._writes.put_nowait((kind, block_hash, tuple(tokens), payload, parent))
        except queue.Full:
            with self._lock:
                self._queued.discard((kind, block_hash))
            return False
        return True

    def has(self, kind: int, key: bytes) -> bool:
        """On disk, or queued to be written (a block or snapshot file)."""
        with self._lock:
            if (kind, key) in self._queued:
                return True
        return self.contains(kind, key)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until queued writes are on disk (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._writes.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._writes.get(timeout=self._until_sweep())
            except queue.Empty:
                self._sweep_if_due()
                continue
            try:
                if item is None:
                    return
                if callable(item):  # a hand-over, run after the writes queued before it
                    item()
                else:
                    self._write(*item)
            except Exception:  # a writer must never die: count and go on
                log.exception("SSD store write failed")
                self._count_error("write")
            finally:
                if isinstance(item, tuple):
                    with self._lock:
                        self._queued.discard((item[0], item[1]))
                self._writes.task_done()
            self._sweep_if_due()

    def _write(self, kind: int, block_hash: bytes, tokens: tuple[int, ...], payload: Sequence[bytes],
               parent: bytes | None) -> None:
        if self._full_until is not None:
            return
        if kind == KIND_RESPONSE:
            assert parent is not None
            path = self.response_path(parent, len(tokens), block_hash)
        else:
            path = self.path(kind, block_hash)
        if path.exists():
            self.contains(kind, block_hash)
            return
        parts = encode(kind, self.namespace, block_hash, tokens, self.layout, payload)
        size = sum(len(p) for p in parts)
        tmp = path.parent / temp_name()
        try:
            self._write_file(tmp, parts)
            os.replace(tmp, path)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            self._write_failed(path, exc)
            return
        self._written(kind, block_hash, path, size, parent, tokens)

    def _written(self, kind: int, key: bytes, path: Path, size: int, parent: bytes | None,
                 tokens: Sequence[int]) -> None:
        """A file this daemon has just put in place: indexed, counted, announced; then room is made."""
        with self._lock:
            self._index[(kind, key)] = StoreEntry(path, size, parent if kind == KIND_RESPONSE else None)
            if kind == KIND_RESPONSE:
                assert parent is not None
                self._responses.setdefault(parent, {})[key] = len(tokens)
            self.used_bytes += size
            self.stats.bytes_written += size
            self.stats.snapshot_bytes_written += size if kind != KIND_BLOCK else 0
            self.stats.files_written += 1
        if kind == KIND_BLOCK and self.events is not None:
            self.events.stored(DISK, key, parent, tokens)
        self._evict()

    def _write_file(self, tmp: Path, parts: Sequence[bytes | memoryview]) -> None:
        for attempt in range(2):
            tmp.parent.mkdir(parents=True, exist_ok=True)
            try:
                with open(tmp, "wb") as f:
                    for part in parts:
                        f.write(part)
                return
            except FileNotFoundError:
                if attempt:  # the folder was removed as it emptied (another daemon's eviction) twice over
                    raise

    def _remove(self, path: Path) -> None:
        """Remove a file and then the response folders it leaves empty: one folder per distinct prompt
        would otherwise outlive its files forever. (A folder with files left refuses rmdir.)"""
        with contextlib.suppress(OSError):
            path.unlink()
        self._prune(path.parent)

    def _prune(self, folder: Path) -> None:
        responses = self.dir / "resp"
        while folder != responses and responses in folder.parents:
            try:
                folder.rmdir()
            except OSError:
                return
            folder = folder.parent

    def _write_failed(self, path: Path, exc: OSError) -> None:
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            self._full_until = time.monotonic() + self.retry_seconds
            self._count_error("enospc")
            log.error("SSD store %s is full: writing pauses (serving goes on) until space is back", self.root)
        else:
            self._count_error("write")
            log.warning("SSD store write of %s failed: %s", path.name, exc)

    def _evict(self) -> None:
        if self.max_bytes is None:
            return
        while True:
            with self._lock:
                if self.used_bytes <= self.max_bytes or not self._index:
                    return
                (kind, key), entry = self._index.popitem(last=False)
                self.used_bytes -= entry.size
                self._drop_response(key, entry)
            self._remove(entry.path)
            self._announce_removed(kind, [key])

    # ---- hand-over: prefill and decode on separate replicas --------------------------------------------
    def handover_dir(self, transfer_id: str) -> Path:
        return self.root / HANDOVER_DIR / transfer_id

    def keep_handovers_for(self, hold_seconds: float) -> None:
        """A prefill replica's store: hand-overs older than `hold_seconds` go, swept by the writer thread
        every quarter of that (at most `SWEEP_SECONDS`), whether or not another is written."""
        self._handover_hold = hold_seconds
        self._next_sweep = time.monotonic()
        with contextlib.suppress(queue.Full):
            self._writes.put_nowait(lambda: None)  # the writer wakes to time its first sweep

    def _until_sweep(self) -> float | None:
        return None if self._handover_hold is None else max(0.0, self._next_sweep - time.monotonic())

    def _sweep_if_due(self) -> None:
        hold = self._handover_hold
        if hold is not None and time.monotonic() >= self._next_sweep:
            try:
                self._sweep_handovers(hold)
            except Exception:  # the writer must never die: a name it cannot judge waits for the next sweep
                log.exception("sweeping hand-overs failed")
            self._next_sweep = time.monotonic() + min(hold / 4, SWEEP_SECONDS)

    def hand_over(self, transfer_id: str, entries: Sequence[tuple[int, bytes]], hold_seconds: float) -> bool:
        """Once the writes queued before it are done, link `entries` ((kind, key): a prefix's blocks in
        order, then the snapshot where it ends) into `handover/<transfer_id>/` with a manifest, for a
        decode replica to fetch. Links keep the bytes even if the store evicts its own names meanwhile.
        The manifest stops at the first file not on disk (a write dropped on a full queue or disk): what
        it lists is still a valid prefix. False if the writer's queue is full (nothing handed over)."""
        items = tuple(entries)
        try:
            self._writes.put_nowait(lambda: self._write_handover(transfer_id, items, hold_seconds))
        except queue.Full:
            return False
        return True

    def _write_handover(self, transfer_id: str, entries: tuple[tuple[int, bytes], ...], hold_seconds: float) -> None:
        if self._handover_hold is None:  # a store not told its hold yet (`keep_handovers_for`) is swept from now on
            self.keep_handovers_for(hold_seconds)
        folder = self.handover_dir(transfer_id)
        tmp = folder.parent / temp_name()
        manifest: list[dict] = []
        try:
            tmp.mkdir(parents=True)
            for kind, key in entries:
                item = self._handover_file(kind, key, tmp)
                if item is None:
                    break
                manifest.append(item)
            (tmp / MANIFEST).write_text(json.dumps({"files": manifest, "complete": len(manifest) == len(entries)}))
            os.replace(tmp, folder)
        except OSError as exc:
            shutil.rmtree(tmp, ignore_errors=True)
            log.warning("hand-over %s could not be written: %s", transfer_id, exc)

    def _handover_file(self, kind: int, key: bytes, folder: Path) -> dict | None:
        """Link one file into a hand-over folder → its manifest entry (None: it is not on disk)."""
        with self._lock:
            entry = self._index.get((kind, key))
            tail = self._responses.get(entry.parent, {}).get(key) if entry and entry.parent else None
        if kind == KIND_RESPONSE and (entry is None or entry.parent is None or tail is None):
            return None
        path = entry.path if entry is not None else self.path(kind, key)
        name = key.hex() + SUFFIX[kind]
        try:
            os.link(path, folder / name)
        except FileNotFoundError:
            return None
        except OSError:  # a file system without hard links: a copy
            try:
                shutil.copyfile(path, folder / name, follow_symlinks=False)
            except OSError:
                return None
        item = {"kind": kind, "key": key.hex(), "name": name, "size": (folder / name).stat().st_size}
        if kind == KIND_RESPONSE:
            assert entry is not None and entry.parent is not None
            item |= {"parent": entry.parent.hex(), "tail": tail}
        return item

    def _sweep_handovers(self, hold_seconds: float) -> None:
        """Hand-overs nobody fetched within `hold_seconds` (and temp folders whose writer is gone) go."""
        now = time.time()
        with contextlib.suppress(OSError):
            for folder in (self.root / HANDOVER_DIR).iterdir():
                with contextlib.suppress(OSError, ValueError, OverflowError):  # a name no writer of ours made
                    mtime = folder.lstat().st_mtime
                    stale = (temp_is_stale(folder.name, mtime, hold_seconds, now) if folder.name.startswith(".tmp-")
                             else now - mtime > hold_seconds)
                    if stale:
                        shutil.rmtree(folder, ignore_errors=True)

    def file_size(self, kind: int, n_tokens: int) -> int:
        """The exact size of a file of `kind` holding `n_tokens` token ids (what a peer's is checked against
        before it is read)."""
        return HEADER_BYTES + 4 * n_tokens + len(self.layout) + self.payload_bytes[kind] + FOOTER_BYTES

    def import_file(self, kind: int, key: bytes, data: bytes | bytearray | memoryview,
                    parent: bytes | None, tokens: bytes) -> int:
        """A file fetched from another replica's hand-over: checked as a read checks it, holding exactly
        `tokens` (packed as files store them) and, for a response end, continuing `parent` (StoreFileError
        otherwise), then written under this store's own name for it → bytes written (0: the store holds
        it already)."""
        decode(data, kind, self.namespace, key, tokens, self.layout, self.payload_bytes[kind])
        ids = file_tokens(data)
        if kind == KIND_RESPONSE:
            if parent is None or chain_hash(parent, ids) != key:
                raise StoreFileError("collision", "a response end that does not continue the block it names")
            path = self.response_path(parent, len(ids), key)
        else:
            path = self.path(kind, key)
        if path.exists():
            return 0
        tmp = path.parent / temp_name()
        try:
            self._write_file(tmp, [data])
            os.replace(tmp, path)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        self._written(kind, key, path, len(data), parent, ids)
        return len(data)

    # ---- reading ----------------------------------------------------------------------------------
    def get(self, kind: int, block_hash: bytes, tokens: Sequence[int] | None, timings: Counter | None = None,
            on_cold: Callable[[], None] | None = None, into: memoryview | None = None) -> memoryview | None:
        """A file's payload, or None (a miss) if absent or bad; bad files are quarantined. Blocks
        for as long as the file system does: call it on a thread that may be abandoned. `timings`
        gets the seconds spent reading ("read") and checking ("verify"). Given `on_cold`, the file is
        first read only from the page cache, and `on_cold` is called before waiting for the disk.
        Given `into` (exactly a payload's size), the payload is read straight into it and returned."""
        key = (kind, block_hash)
        path = self._file(kind, block_hash)
        if path is None:
            return None
        t0 = time.perf_counter()
        try:
            data = self._read_file(path, kind, on_cold, into)
        except FileNotFoundError:
            self._forget(key)
            return None
        except (OSError, MemoryError) as exc:  # a symlink (ELOOP), an I/O error, no memory for the buffer
            self._bad(key, path, StoreFileError("unreadable", str(exc) or type(exc).__name__))
            return None
        except StoreFileError as exc:
            self._bad(key, path, exc)
            return None
        t1 = time.perf_counter()
        try:
            payload = decode(data, kind, self.namespace, block_hash, tokens, self.layout, self.payload_bytes[kind],
                             into)
        except StoreFileError as exc:
            self._bad(key, path, exc)
            return None
        if timings is not None:
            timings["read"] += t1 - t0
            timings["verify"] += time.perf_counter() - t1
        with self._lock:
            if key in self._index:
                self._index.move_to_end(key)
            self.stats.bytes_read += len(data) + (len(into) if into is not None else 0)
        return payload

    def _read_file(self, path: str | Path, kind: int, on_cold: Callable[[], None] | None = None,
                   into: memoryview | None = None) -> bytearray:
        """A store file's bytes, read by the rules of `read_store_file`."""
        return read_store_file(path, kind, self.layout, self.payload_bytes[kind], on_cold, into)

    def get_many(self, kind: int, items: Sequence[Item], timings: Counter | None = None,
                 into: Sequence[memoryview] | None = None,
                 asked: Callable[[], None] | None = None) -> Sequence[memoryview]:
        """Payloads of consecutive files up to the first miss, read in order. The reader process hands
        every file to the kernel to read (`posix_fadvise` WILLNEED) before it reads the first
        (`ssd_reader._ReadAhead`); on this process's threads (no reader process), at the first file
        not in the page cache a second thread asks for the rest (read-ahead of files in the page cache
        doubled a 128-file hit's time there). An SSD then serves them in parallel. A read still running after
        `read_timeout` ends the prefix where it stands. `timings` gets the seconds spent reading and
        checking. Given `into`, file i's payload is read straight into `into[i]`. Given `asked`, it is called
        once the files are asked for (the reader process has the request; on this process's threads,
        before the first read), not at all if none is."""
        if self.reader is not None:
            try:
                return self._get_many_in_reader(kind, items, timings, into, asked)
            except NoSharedMemory as exc:  # no room in /dev/shm (raised before any file is read): read here
                log.warning("SSD store: %s: read in this process", exc.strerror)
        if asked is not None:
            asked()
        return self._get_many_in_threads(kind, items, timings, into)

    def _get_many_in_threads(self, kind: int, items: Sequence[Item], timings: Counter | None = None,
                             into: Sequence[memoryview] | None = None) -> list[memoryview]:
        """`get_many` on this process's threads (no reader process, or no shared memory for it)."""
        out: list[memoryview] = []
        spent: Counter = Counter()
        ahead: list[bool] = []

        def read_ahead() -> None:
            if not ahead:
                ahead.append(True)
                rest = items[len(out) + 1:]
                in_daemon_thread(lambda: self._read_ahead(kind, rest))

        def read_all() -> None:
            for i, (block_hash, tokens) in enumerate(items):
                row = into[i] if into is not None else None
                payload = self.get(kind, block_hash, tokens, spent, on_cold=read_ahead, into=row)
                if payload is None:
                    return
                out.append(payload)

        try:
            in_daemon_thread(read_all).result(timeout=self.read_timeout)
        except FutureTimeout:
            self._count_error("timeout")
            done = list(out)  # what was read before the stuck file (the thread may still add to `out`)
            stuck = items[min(len(done), len(items) - 1)][0]
            log.warning("SSD store read of %s did not return in %.1f s: a miss", stuck.hex()[:16], self.read_timeout)
            return done
        if timings is not None:
            timings.update(spent)
        return out

    def _get_many_in_reader(self, kind: int, items: Sequence[Item], timings: Counter | None,
                            into: Sequence[memoryview] | None,
                            asked: Callable[[], None] | None = None) -> Sequence[memoryview]:
        """`get_many` through the reader process: it reads and checks the files into its shared memory,
        this process copies each batch of good payloads to where they go (without the interpreter's
        lock) and keeps the index. A reader that dies or times out ends the prefix where it stands,
        and is replaced. NoSharedMemory (no room in /dev/shm) comes before any file is read."""
        assert self.reader is not None
        files = self._file_requests(kind, items)
        out: list[memoryview] = []  # without `into`: each payload in a buffer of its own
        taken = 0
        try:
            if not files:
                return out
            deadline = time.monotonic() + self.read_timeout
            for shared, batch in self.reader.read(kind, files, deadline, asked):
                good = [o for o in batch if o[1] == OK]
                rows = self._take_payloads(kind, items, shared, good, into)
                taken += len(good)
                if into is None:
                    out += rows
                if timings is not None:
                    timings["read"] += sum(o[4] for o in good)
                    timings["verify"] += sum(o[5] for o in good)
                if len(good) < len(batch):
                    i, outcome, detail = batch[len(good)][:3]
                    self._read_failed((kind, items[i][0]), files[i][0], outcome, detail)
        except ReaderGone as exc:
            self._count_error("timeout" if str(exc) == "timeout" else "reader")
            log.warning("SSD store reader process %s after %d of %d files: the rest a miss", exc, taken, len(files))
        return into[:taken] if into is not None else out

    def _file_requests(self, kind: int, items: Sequence[Item]) -> list[FileRequest]:
        """The reader process's request: each file's path, hash and token ids, up to the first file the
        index cannot name."""
        files = []
        for block_hash, tokens in items:
            path = self._file(kind, block_hash)
            if path is None:
                break
            token_bytes = pack_tokens(tokens) if tokens is not None else None
            files.append((os.fspath(path), block_hash, token_bytes))
        return files

    def _read_failed(self, key: tuple[int, bytes], path: str, outcome: str, detail: str) -> None:
        if outcome == MISSING:
            self._forget(key)
        else:
            self._bad(key, path, StoreFileError(outcome, detail))

    def _take_payloads(self, kind: int, items: Sequence[Item], shared: memoryview, good: list[Outcome],
                       into: Sequence[memoryview] | None) -> Sequence[memoryview]:
        """A batch of good payloads out of shared memory (payload i at [i * size, (i + 1) * size]): into
        their rows, or buffers of their own. Consecutive rows of one buffer (`DeviceKV.block_rows`) take
        one copy for the batch."""
        if not good:
            return []
        first, count, size = good[0][0], len(good), self.payload_bytes[kind]
        rows = into[first:first + count] if into is not None else [memoryview(bytearray(size)) for _ in good]
        copy_rows_without_the_gil(rows, shared[first * size:(first + count) * size])
        with self._lock:
            for i, *_ in good:
                if (kind, items[i][0]) in self._index:
                    self._index.move_to_end((kind, items[i][0]))
            self.stats.bytes_read += sum(o[3] for o in good)
        return rows

    def _read_ahead(self, kind: int, items: Sequence[Item]) -> None:
        """Ask the kernel to start reading every file now (a hint: one that fails changes nothing)."""
        if not items or not hasattr(os, "posix_fadvise"):
            return
        for block_hash, _ in items:
            path = self._file(kind, block_hash)
            if path is not None and not will_need(path):
                return

    def read(self, kind: int, block_hash: bytes, tokens: Sequence[int] | None,
             timings: Counter | None = None) -> memoryview | None:
        """One file's payload, with the read timeout, read on this process's threads: a hit's snapshot is
        read beside its blocks, which the reader process serves one request at a time (through it,
        the snapshot's read came first and the blocks' waited for it: 1-3 ms of a 16K-token hit). One
        file's Python work holds the interpreter's lock for tens of microseconds, not the hundreds of
        times a hit's block files did."""
        found = self._get_many_in_threads(kind, [(block_hash, tokens)], timings)
        return found[0] if found else None

    def submit(self, fn: Callable[[], T]) -> Future:
        """Run a load on the loader pool (never on the engine step); loads wait only with timeouts."""
        return self._readers.submit(fn)

    def _forget(self, key: tuple[int, bytes]) -> None:
        with self._lock:
            entry = self._index.pop(key, None)
            if entry is not None:
                self.used_bytes -= entry.size
                self._drop_response(key[1], entry)
        if entry is not None:
            self._announce_removed(key[0], [key[1]])

    def _announce_removed(self, kind: int, hashes: list[bytes]) -> None:
        if kind == KIND_BLOCK and self.events is not None:
            self.events.removed(DISK, hashes)

    def _drop_response(self, key: bytes, entry: StoreEntry) -> None:
        """(Under the lock.) An evicted or bad response-end file leaves the parent index too."""
        if entry.parent is not None:
            keys = self._responses.get(entry.parent, {})
            keys.pop(key, None)
            if not keys:
                self._responses.pop(entry.parent, None)

    def _count_error(self, kind: str) -> None:
        with self._lock:
            self.stats.errors[kind] += 1

    def stats_snapshot(self) -> StoreStats:
        """A consistent copy of the counters, safe to hand to another thread."""
        with self._lock:
            return StoreStats(self.stats.bytes_read, self.stats.bytes_written, self.stats.snapshot_bytes_written,
                              self.stats.files_written, Counter(self.stats.errors))

    # ---- quarantine ---------------------------------------------------------------------------------
    def _bad(self, key: tuple[int, bytes], name: str | Path, exc: StoreFileError) -> None:
        path = Path(name)
        self._count_error(exc.kind)
        log.warning("SSD store file %s is bad (%s: %s): treated as a miss and quarantined", path.name, exc.kind, exc)
        self._forget(key)
        with contextlib.suppress(OSError):
            self.quarantine.mkdir(parents=True, exist_ok=True)
            os.replace(path, self.quarantine / f"{path.name}.{exc.kind}.{uuid.uuid4().hex[:8]}")
        self._prune(path.parent)
        self._trim_quarantine()

    def _count_quarantine(self) -> int:
        try:
            return sum(1 for _ in self.quarantine.iterdir())
        except OSError:
            return 0

    def _trim_quarantine(self) -> None:
        """Keep the newest MAX_QUARANTINE_FILES bad files for inspection; remove older ones."""
        with self._lock:
            try:
                entries = sorted(self.quarantine.iterdir(), key=lambda p: p.lstat().st_mtime)
            except OSError:
                return
            for old in entries[: max(0, len(entries) - MAX_QUARANTINE_FILES)]:
                with contextlib.suppress(OSError):
                    if old.is_dir() and not old.is_symlink():
                        shutil.rmtree(old)
                    else:
                        old.unlink()
            self.quarantined = min(len(entries), MAX_QUARANTINE_FILES)

    # ---- admin ------------------------------------------------------------------------------------
    def clear(self) -> int:
        """Delete every block and snapshot file of this namespace, including ones other daemons
        sharing the folder wrote (reset_prefix_cache with the store); returns how many."""
        self.flush()
        with self._lock:
            blocks = [h for kind, h in self._index if kind == KIND_BLOCK]
            self._index.clear()
            self._responses.clear()
            self.used_bytes = 0
        removed = 0
        for dirpath, _, names in os.walk(self.dir, topdown=False):
            for name in names:
                if any(name.endswith(s) for s in SUFFIX.values()):
                    with contextlib.suppress(FileNotFoundError):
                        (Path(dirpath) / name).unlink()
                        removed += 1
            self._prune(Path(dirpath))
        self._announce_removed(KIND_BLOCK, blocks)
        return removed

    def close(self) -> None:
        self.flush()
        self._writes.put(None)
        self._writer.join(timeout=10)
        self._readers.shutdown(wait=True)
        if self.reader is not None:
            self.reader.close()
