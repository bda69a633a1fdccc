"""The SSD store's reader process: block files read, and checked, in an interpreter of their own.

Why a process: a reader thread's per-file Python work (open, fstat, preadv, checksum, the header's
checks) took the engine process's GIL hundreds of times a hit, and each time the engine thread (which
lets go of it on every torch op) waited for it back: a decode beside a 64K-token disk hit stepped
4.8x slower. In a child interpreter that work contends with nothing; the engine process only sends
one small request (paths, hashes, token ids) and gets one small message back per file.

Payloads travel through shared memory: the engine side creates a file in /dev/shm sized for the
request's payloads, the child reads payload i straight into slot i of its mapping (the rest of each
file into its own buffer), checks the whole file by the store's rules (`read_store_file`, `decode`:
XXH3 included) and reports (request id, index, outcome). The engine side copies a slot into its
destination only after the child reported it good. Plain Python, no torch.

A child that dies or stops answering ends the request where it stands (the rest a miss) and is
replaced on the next request: a dead reader costs a miss, never a crash or a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from v4serve.cache.ssd_file import StoreFileError, decode, read_store_file, will_need

# A file's outcome as the child reports it: "ok", "missing" (vanished), or a StoreFileError kind.
OK, MISSING = "ok", "missing"
FileRequest = tuple[str, bytes, bytes | None]  # (path, chain hash, token ids as int32 bytes or None)
# (index, outcome, detail, the file's bytes, read seconds, verify seconds)
Outcome = tuple[int, str, str, int, float, float]
BATCH_FILES = 32  # files a completion message reports (the last one of a request: fewer)
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()


def copy_rows_without_the_gil(rows: Sequence[memoryview], src: memoryview) -> None:
    """The rows, in order, filled from `src` (writable, as long as all of them), with the interpreter's lock
    released for the copy (ctypes lets go of it around a foreign call): a slice assignment holds it
    for a whole payload, and every torch op of the engine thread that ends meanwhile waits for it
    back, the convoy this process exists to avoid. Rows that follow one another in memory (one host
    buffer's) are one copy."""
    if sum(len(r) for r in rows) != len(src):
        raise ValueError(f"{len(src)} bytes for rows of {sum(len(r) for r in rows)}")
    offset = 0
    for start, length in _runs(rows):
        ctypes.memmove(start, _address(src[offset:offset + length]), length)
        offset += length


def _address(view: memoryview) -> int:
    return ctypes.addressof((ctypes.c_char * len(view)).from_buffer(view)) if len(view) else 0


def _runs(rows: Sequence[memoryview]) -> list[tuple[int, int]]:
    """(address, length) of each stretch of rows that follow one another in memory."""
    runs: list[list[int]] = []
    for row in rows:
        if not len(row):
            continue
        address = _address(row)
        if runs and runs[-1][0] + runs[-1][1] == address:
            runs[-1][1] += len(row)
        else:
            runs.append([address, len(row)])
    return [(a, n) for a, n in runs]


class ReaderGone(Exception):
    """The reader process died or stopped answering; what it had not reported is a miss."""


class SharedSlots:
    """`count` payload slots of `size` bytes in a /dev/shm file both processes map; the file is
    unlinked once mapped here and in the child, so nothing outlives the two mappings."""

    def __init__(self, count: int, size: int) -> None:
        self.path = os.path.join(_SHM_DIR, f"v4serve-read-{os.getpid()}-{uuid.uuid4().hex}")
        self.size, nbytes = size, max(1, count * size)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            # Allocated now, not as the child writes: a full /dev/shm (64 MiB in a default container) is
            # then an OSError here, where the store falls back to reading in this process, not a SIGBUS
            # in the child.
            os.posix_fallocate(fd, 0, nbytes)
            self._map = mmap.mmap(fd, nbytes)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.view = memoryview(self._map)

    def slot(self, i: int) -> memoryview:
        return self.view[i * self.size:(i + 1) * self.size]

    def close(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        self.view.release()
        with contextlib.suppress(BufferError):  # a payload view still held: the mapping goes with it
            self._map.close()


class ReaderProcess:
    """The engine side: one child process, started lazily, replaced when it dies. Requests are
    served one at a time (the child reads one file at a time anyway; the kernel's read-ahead is what
    reads in parallel)."""

    def __init__(self, namespace: bytes, layout: bytes, payload_bytes: dict[int, int]) -> None:
        self._config = (namespace, layout, dict(payload_bytes))
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self.restarts = 0
        self._closed = False

    def start(self) -> None:
        """Start the child now (its interpreter takes ~0.1-0.5 s to start: not on the first hit's time)."""
        with self._lock:
            self._start()

    def _start(self) -> Connection:
        if self._closed:  # a load still running as the store closed: a miss, not a new child
            raise ReaderGone("closed")
        if self._proc is not None and self._proc.poll() is None and self._conn is not None:
            return self._conn
        if self._proc is not None:
            self._stop()
            self.restarts += 1
        ours, theirs = socket.socketpair()
        # A plain interpreter running this module (not multiprocessing's spawn, which would import the
        # parent's __main__, e.g. the server with torch, into the child): it starts in ~0.1 s.
        cmd = [sys.executable, "-c", f"from v4serve.cache.ssd_reader import main; main({theirs.fileno()})"]
        try:
            self._proc = subprocess.Popen(cmd, pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                          start_new_session=True)  # a terminal's Ctrl-C goes to the engine only
        finally:
            theirs.close()
        self._conn = Connection(ours.detach())
        self._conn.send(self._config)
        return self._conn

    def read(self, kind: int, slots: SharedSlots, files: Sequence[FileRequest],
             deadline: float) -> Iterator[list[Outcome]]:
        """The files' outcomes in order, in batches (one message, and one wake-up of this process's
        reading thread, per BATCH_FILES files: each wake-up takes the interpreter's lock from the
        engine thread), up to the first that is not OK. Raises ReaderGone if the child dies or the
        deadline passes (then the child is ended: it may be stuck on the file system)."""
        with self._lock:
            try:
                conn = self._start()  # a child that cannot start (no memory, no fds): ReaderGone below
                request_id = uuid.uuid4().hex
                conn.send((request_id, kind, slots.path, list(files)))
                while True:
                    if not conn.poll(max(0.0, deadline - time.monotonic())):
                        self._stop()
                        raise ReaderGone("timeout")
                    reply_id, outcomes, done = conn.recv()
                    if reply_id != request_id:
                        continue  # an answer to a request abandoned earlier
                    if outcomes:
                        yield outcomes
                    if done:
                        return
            except (EOFError, OSError) as exc:
                self._stop()
                raise ReaderGone(str(exc) or type(exc).__name__) from exc

    def _stop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(OSError):
                self._conn.close()
            self._conn = None
        if self._proc is not None:
            with contextlib.suppress(OSError):
                self._proc.kill()  # never waited for long: a child in the kernel's I/O wait reaps later
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=1.0)

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(OSError):
                    self._conn.send(None)
            self._stop()
            self._closed = True
            self._proc = None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None


# ---- the child ------------------------------------------------------------------------------------
def main(fd: int) -> None:
    conn = Connection(fd)
    namespace, layout, payload_bytes = conn.recv()
    while True:
        try:
            request = conn.recv()
        except (EOFError, OSError):
            return  # the engine process is gone
        if request is None:
            return
        request_id, kind, shm_path, files = request
        _serve(conn, request_id, kind, shm_path, files, namespace, layout, payload_bytes[kind])


def _serve(conn: Connection, request_id: str, kind: int, shm_path: str, files: Sequence[FileRequest],
           namespace: bytes, layout: bytes, size: int) -> None:
    try:
        fd = os.open(shm_path, os.O_RDWR)
        try:
            shared = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
    except OSError as exc:  # the engine side gave up on this request already
        conn.send((request_id, [(0, "unreadable", f"shared memory: {exc}", 0, 0.0, 0.0)], True))
        return
    view = memoryview(shared)
    ahead: list[bool] = []
    batch: list[Outcome] = []
    try:
        for i, (path, block_hash, token_bytes) in enumerate(files):
            outcome = _read_one(path, kind, block_hash, token_bytes, view[i * size:(i + 1) * size], namespace,
                                layout, size, lambda i=i: _read_ahead_once(ahead, files[i + 1:]))
            batch.append((i, *outcome))
            if outcome[0] != OK:
                break
            if len(batch) == BATCH_FILES:
                conn.send((request_id, batch, False))
                batch = []
        conn.send((request_id, batch, True))
    finally:
        view.release()
        shared.close()


def _read_one(path: str, kind: int, block_hash: bytes, token_bytes: bytes | None, slot: memoryview,
              namespace: bytes, layout: bytes, size: int, on_cold: object) -> tuple[str, str, int, float, float]:
    tokens = memoryview(token_bytes).cast("i").tolist() if token_bytes is not None else None
    t0 = time.perf_counter()
    try:
        data = read_store_file(path, kind, layout, size, on_cold, slot)  # type: ignore[arg-type]
    except FileNotFoundError:
        return MISSING, "", 0, 0.0, 0.0
    except (OSError, MemoryError) as exc:
        return "unreadable", str(exc) or type(exc).__name__, 0, 0.0, 0.0
    except StoreFileError as exc:
        return exc.kind, str(exc), 0, 0.0, 0.0
    t1 = time.perf_counter()
    try:
        decode(data, kind, namespace, block_hash, tokens, layout, size, slot)
    except StoreFileError as exc:
        return exc.kind, str(exc), 0, 0.0, 0.0
    return OK, "", len(data) + size, t1 - t0, time.perf_counter() - t1


def _read_ahead_once(ahead: list[bool], rest: Sequence[FileRequest]) -> None:
    """At the first file not in the page cache, ask the kernel to read the rest ahead, on a thread
    (this process's own interpreter: it holds up only this child's reads, by microseconds)."""
    if ahead or not rest or not hasattr(os, "posix_fadvise"):
        return
    ahead.append(True)
    threading.Thread(target=_fadvise_all, args=([p for p, _, _ in rest],), daemon=True).start()


def _fadvise_all(paths: Sequence[str]) -> None:
    for path in paths:
        if not will_need(path):
            return


def shm_leftovers() -> list[Path]:
    """This process's shared-memory files still present (tests: none once a read returns)."""
    return sorted(Path(_SHM_DIR).glob(f"v4serve-read-{os.getpid()}-*"))
