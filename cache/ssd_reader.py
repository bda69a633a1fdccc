"""The SSD store's reader process: block files read, and checked, in an interpreter of their own.

Why a process: a reader thread's per-file Python work (open, fstat, preadv, checksum, the header's
checks) took the engine process's GIL hundreds of times a hit, and each time the engine thread (which
lets go of it on every torch op) waited for it back: a decode beside a 64K-token disk hit stepped
4.8x slower. In a child interpreter that work contends with nothing; the engine process only sends
one small request (paths, hashes, token ids) and gets one small message back per file.

Payloads travel through shared memory: one file in /dev/shm (`SharedSlots`) that the engine side
allocates at the first read, grows when a read needs more (never shrinks) and reuses for every read
after, both processes keeping it mapped (a fresh 128 MiB file per 64K-token hit, zeroed and faulted
in page by page by both processes, was two thirds of such a hit's time from the page cache). The child reads
payload i straight into slot i of its mapping (the rest of each file into its own buffer), checks the
whole file by the store's rules (`read_opened`, `decode`: XXH3 over the slot's bytes included)
and reports (request id, index, outcome). The engine side copies a slot into its destination only
after the child reported it good for this request's id, in file order, so what an earlier read left
in a slot is never taken for a payload. One request at a time, under the engine side's lock: the
slots are written by one request only. A child ended but not seen to exit (stuck in the kernel, where
a read may still land in its mapping) takes the file with it: the next read gets a new one. A
crashed engine's file is removed by the next store that starts (`sweep_shm_leftovers`).

A child that dies or stops answering ends the request where it stands (the rest a miss) and is
replaced on the next request: a dead reader costs a miss, never a crash or a hang.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import logging
import mmap
import os
import re
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Iterator, Sequence
from multiprocessing.connection import Connection
from pathlib import Path

from v4serve.cache.ssd_file import StoreFileError, _process_alive, decode, open_store_file, read_opened

# A file's outcome as the child reports it: "ok", "missing" (vanished), or a StoreFileError kind;
# SHARED_MEMORY (first and only outcome of a reply): the child could not map the request's shared memory.
OK, MISSING, SHARED_MEMORY = "ok", "missing", "shared-memory"
FileRequest = tuple[str, bytes, bytes | None]  # (path, chain hash, token ids as `pack_tokens` packs them, or None)
# (index, outcome, detail, the file's bytes, read seconds, verify seconds)
Outcome = tuple[int, str, str, int, float, float]
BATCH_FILES = 32  # files a completion message reports (the last one of a request: fewer)
MAX_OPEN_FILES = 256  # descriptors the child keeps open between advising a request's files and reading them
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
_SHM_PREFIX = "v4serve-read-"
_SHM_NAME = re.compile(rf"{_SHM_PREFIX}([0-9]+)-[0-9a-f]{{32}}")  # v4serve-read-<engine pid>-<uuid4 hex>
_SHM_GROWTH = 1.25  # a buffer that must grow grows to at least this many times its size (fewer remaps)
_SHM_ROUND = 1 << 20
_POPULATE = getattr(mmap, "MAP_POPULATE", 0)  # Linux: the mapping's page tables filled now, not at first touch
# The most shared memory a reader makes ready at its start (`ReaderProcess.start`): a default container's
# /dev/shm is 64 MiB. A read that needs more grows it then.
RESERVE_CAP = 16 << 20
_RESERVE_TIMEOUT = 60.0  # seconds the child has to start and map the reserved memory

log = logging.getLogger(__name__)


class ContiguousRows(Sequence[memoryview]):
    """`n` rows of `width` bytes one after another in one writable buffer (a load's host rows): row i is
    a view made when asked for, and a run of rows is one view, so a 512-block load makes no 512 views
    up front (they were 2 ms of a 64K-token hit before its reads were even asked for) and its payloads
    are one copy per batch."""

    def __init__(self, buffer: memoryview, width: int, n: int) -> None:
        if len(buffer) < width * n:
            raise ValueError(f"{len(buffer)} bytes for {n} rows of {width}")
        self.buffer, self.width, self.n = buffer, width, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i):  # type: ignore[no-untyped-def, override]
        if isinstance(i, slice):
            start, stop, step = i.indices(self.n)
            if step != 1:
                raise ValueError("rows are taken in runs, not with a step")
            stop = max(start, stop)
            return ContiguousRows(self.buffer[start * self.width:stop * self.width], self.width, stop - start)
        if i < 0:
            i += self.n
        if not 0 <= i < self.n:
            raise IndexError(i)
        return self.buffer[i * self.width:(i + 1) * self.width]

    def span(self) -> memoryview:
        """All the rows as one view."""
        return self.buffer[:self.n * self.width]


def copy_rows_without_the_gil(rows: Sequence[memoryview], src: memoryview) -> None:
    """The rows, in order, filled from `src` (writable, as long as all of them), with the interpreter's lock
    released for the copy (ctypes lets go of it around a foreign call): a slice assignment holds it
    for a whole payload, and every torch op of the engine thread that ends meanwhile waits for it
    back, the convoy this process exists to avoid. Rows that follow one another in memory (one host
    buffer's) are one copy."""
    total = rows.n * rows.width if isinstance(rows, ContiguousRows) else sum(len(r) for r in rows)
    if total != len(src):
        raise ValueError(f"{len(src)} bytes for rows of {total}")
    offset = 0
    runs = [(_address(rows.span()), total)] if isinstance(rows, ContiguousRows) and total else _runs(rows)
    for start, length in runs:
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


class NoSharedMemory(OSError):
    """No room in /dev/shm for a read's payloads (the store then reads in its own process)."""


class SharedSlots:
    """The reader's payload slots: a /dev/shm file of at least `nbytes` that both processes map, a
    request's payload i at [i * payload size, (i + 1) * payload size). Allocated in full now
    (`posix_fallocate`: a full /dev/shm, 64 MiB in a default container, is an OSError here, where the
    store falls back to reading in its own process, not a SIGBUS in the child). Its owner
    (`ReaderProcess`) reuses it for every read and removes it at `close`. Held open and share-locked
    (`flock`) while it lives: what `sweep_shm_leftovers` checks, whatever the pid in its name means to
    a process in another pid namespace."""

    def __init__(self, nbytes: int) -> None:
        self.path = os.path.join(_SHM_DIR, f"{_SHM_PREFIX}{os.getpid()}-{uuid.uuid4().hex}")
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            self.inode = os.fstat(self._fd).st_ino
            self._map = self._allocate(self._fd, nbytes)
        except BaseException:
            _remove(self.path, self._fd)
            raise
        self.view = memoryview(self._map)
        # Removed at `close`, or else when this is collected or the interpreter exits (a store never
        # closed); an engine killed outright leaves it to the next store's `sweep_shm_leftovers`.
        self._remove = weakref.finalize(self, _remove, self.path, self._fd)

    @staticmethod
    def _allocate(fd: int, nbytes: int) -> mmap.mmap:
        nbytes = max(mmap.PAGESIZE, -(-nbytes // mmap.PAGESIZE) * mmap.PAGESIZE)
        os.posix_fallocate(fd, 0, nbytes)
        # Not pre-faulted here: made for a read, this side's pages fault in at its copies, while the child
        # reads the next files (pre-faulting them before the request made a first hit slower), and stay.
        # Made ahead of any read, `populate` faults them in.
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)

    def populate(self) -> None:
        """This side's pages faulted in now (writable), not at the first read's copies: one write a page."""
        self.view[::mmap.PAGESIZE] = bytes(len(range(0, len(self.view), mmap.PAGESIZE)))

    @property
    def nbytes(self) -> int:
        return len(self.view)

    def present(self) -> bool:
        """The file is still there under its name (the child maps it by name)."""
        try:
            return os.stat(self.path).st_ino == self.inode
        except OSError:
            return False

    def grow(self, nbytes: int) -> None:
        """At least `nbytes` (the same file, extended: its name and the pages it had stay). An OSError
        (no room) leaves it as it was."""
        if nbytes <= self.nbytes:
            return
        target = max(nbytes, -(-int(self.nbytes * _SHM_GROWTH) // _SHM_ROUND) * _SHM_ROUND)
        try:
            new = self._allocate(self._fd, target)
        except OSError:
            if target == nbytes:
                raise
            new = self._allocate(self._fd, nbytes)  # the margin did not fit; what is needed may
        self._unmap()
        self._map, self.view = new, memoryview(new)

    def _unmap(self) -> None:
        with contextlib.suppress(BufferError):  # a payload view still held: the mapping goes with it
            self.view.release()
            self._map.close()

    def close(self, unlink: bool = True) -> None:
        """Unmapped, closed and (`unlink`: unless its name is another file's now) removed."""
        if unlink:
            self._remove()
        elif self._remove.detach() is not None:
            os.close(self._fd)
        self._unmap()


def _remove(path: str, fd: int) -> None:
    """Unlinked before its lock goes with the descriptor: a sweep never finds it present and unlocked."""
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)
    os.close(fd)


def _map(fd: int, nbytes: int) -> mmap.mmap:
    """(The child.) A shared, writable mapping of the file's first `nbytes`, its pages mapped now, in
    one call (its reads into the slots would fault them in one page at a time, in the same order)."""
    try:
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | _POPULATE)
    except OSError:
        if not _POPULATE:
            raise
        return mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)


def sweep_shm_leftovers(folder: str | Path | None = None) -> list[str]:
    """Remove the reader shared-memory files of engine processes that are gone (a crashed engine's:
    `close` removes a live one's) → the names removed. Only names of this module's exact pattern, and
    never one whose process is alive (or, its pid being taken again since, looks alive), nor one a
    live `SharedSlots` holds locked (an engine whose pid means another process here: a /dev/shm
    shared across pid namespaces)."""
    folder = os.fspath(folder if folder is not None else _SHM_DIR)
    removed: list[str] = []
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        match = _SHM_NAME.fullmatch(name)
        if match is None or int(match.group(1)) in (0, os.getpid()) or _process_alive(int(match.group(1))):
            continue
        path = os.path.join(folder, name)
        try:  # another user's (0600), removed meanwhile, or not a regular file: not ours to remove
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                continue
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held by a live engine: BlockingIOError
            if os.stat(path, follow_symlinks=False).st_ino == os.fstat(fd).st_ino:
                os.unlink(path)
                removed.append(name)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class ReaderProcess:
    """The engine side: one child process, started lazily, replaced when it dies, and the shared
    memory its reads go through (`SharedSlots`, kept from read to read). Requests are served one at
    a time (the child reads one file at a time anyway; the kernel's read-ahead is what reads in
    parallel)."""

    def __init__(self, namespace: bytes, layout: bytes, payload_bytes: dict[int, int]) -> None:
        self._config = (namespace, layout, dict(payload_bytes))
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._conn: Connection | None = None
        self._slots: SharedSlots | None = None
        self.restarts = 0
        self._closed = False

    def start(self, reserve: int = 0) -> None:
        """Start the child now (its interpreter takes ~0.1-0.5 s to start: not on the first hit's time).
        Given `reserve` (bytes, at most RESERVE_CAP), also make the shared memory that large and have
        both processes map it, on a thread of its own: a first hit that fits then neither allocates
        nor maps it (at 16K tokens on the tiny model, ~1 ms each side of 3.3 MB, in the hit's time)."""
        with self._lock:
            self._start()
        if reserve > 0:
            threading.Thread(target=self._reserve, args=(min(reserve, RESERVE_CAP),), name="v4serve-ssd-reserve",
                             daemon=True).start()

    def _reserve(self, nbytes: int) -> None:
        """The shared memory made `nbytes` large and mapped by both sides, pages and all (an empty request
        has the child map it). Any failure leaves it to the first read, as without a reserve."""
        try:
            with self._lock:
                if self._closed:
                    return
                self._slots_for(nbytes).populate()
            kind = next(iter(self._config[2]))
            for _ in self.read(kind, [], time.monotonic() + _RESERVE_TIMEOUT):
                pass
        except (NoSharedMemory, ReaderGone) as exc:
            log.debug("SSD store reader: no shared memory reserved ahead of reads: %s", exc)

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

    def _slots_for(self, nbytes: int) -> SharedSlots:
        """The shared memory, at least `nbytes` of it: the one of earlier reads, grown if need be, or a
        new one (the first read, or the file is gone: /dev/shm cleaned under us). NoSharedMemory if
        there is no room (what was there stays, for reads it fits)."""
        try:
            if self._slots is not None and not self._slots.present():  # its name is not ours to remove now
                self._slots.close(unlink=False)
                self._slots = None
            if self._slots is None:
                self._slots = SharedSlots(nbytes)
            else:
                self._slots.grow(nbytes)
        except OSError as exc:
            raise NoSharedMemory(exc.errno, f"no shared memory for {nbytes} bytes ({exc.strerror or exc})") from exc
        return self._slots

    def _drop_slots(self) -> None:
        if self._slots is not None:
            self._slots.close()
            self._slots = None

    def read(self, kind: int, files: Sequence[FileRequest], deadline: float,
             asked: Callable[[], None] | None = None) -> Iterator[tuple[memoryview, list[Outcome]]]:
        """The files' outcomes in order, in batches (one message, and one wake-up of this process's
        reading thread, per BATCH_FILES files: each wake-up takes the interpreter's lock from the
        engine thread), up to the first that is not OK, each with the shared memory its payloads are in
        (payload i at [i * size, (i + 1) * size]: good only until the next batch is asked for). Raises
        NoSharedMemory before anything is read if /dev/shm has no room for the payloads, ReaderGone if
        the child dies or the deadline passes (then the child is ended: it may be stuck on the file
        system)."""
        with self._lock:
            if self._closed:
                raise ReaderGone("closed")
            slots = self._slots_for(len(files) * self._config[2][kind])
            try:
                conn = self._start()  # a child that cannot start (no memory, no fds): ReaderGone below
                request_id = uuid.uuid4().hex
                conn.send((request_id, kind, slots.path, list(files)))
                if asked is not None:
                    asked()
                reported = 0  # outcomes come in file order, each file once, ending at the first not OK
                while True:
                    if not conn.poll(max(0.0, deadline - time.monotonic())):
                        self._stop()
                        raise ReaderGone("timeout")
                    reply_id, outcomes, done = conn.recv()
                    if reply_id != request_id:
                        continue  # an answer to a request abandoned earlier
                    if outcomes and outcomes[0][1] == SHARED_MEMORY:  # the next read makes a new file
                        self._drop_slots()
                        raise ReaderGone(f"shared memory: {outcomes[0][2]}")
                    if [o[0] for o in outcomes] != list(range(reported, reported + len(outcomes))) or any(
                            o[1] != OK for o in outcomes[:-1]) or (outcomes and outcomes[-1][1] != OK and not done):
                        self._stop()  # never a slot taken for another file's payload
                        raise ReaderGone(f"outcomes out of order after {reported} files")
                    reported += len(outcomes)
                    if outcomes:
                        yield slots.view, outcomes
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
            try:
                self._proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                # Still there: a read it had under way may yet land in the shared memory, over a payload
                # the next child has checked. That file is this child's alone now; the next read makes one.
                self._drop_slots()

    def close(self) -> None:
        with self._lock:
            if self._conn is not None:
                with contextlib.suppress(OSError):
                    self._conn.send(None)
            self._stop()
            self._closed = True
            self._proc = None
            self._drop_slots()

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    @property
    def shm_path(self) -> str | None:
        """The shared-memory file reads go through (None before the first read and after close)."""
        return self._slots.path if self._slots is not None else None


# ---- the child ------------------------------------------------------------------------------------
def main(fd: int) -> None:
    conn = Connection(fd)
    namespace, layout, payload_bytes = conn.recv()
    shared = _Mapping()
    try:
        while True:
            try:
                request = conn.recv()
            except (EOFError, OSError):
                return  # the engine process is gone
            if request is None:
                return
            request_id, kind, shm_path, files = request
            _serve(conn, request_id, kind, shm_path, files, namespace, layout, payload_bytes[kind], shared)
    finally:
        shared.close()


class _Mapping:
    """The child's mapping of the engine side's shared memory, kept from request to request; mapped
    again only when a request names another file or needs more than is mapped (the file grew)."""

    def __init__(self) -> None:
        self.path: str | None = None
        self._map: mmap.mmap | None = None
        self.view = memoryview(b"")

    def of(self, path: str, nbytes: int) -> memoryview:
        if path != self.path or len(self.view) < nbytes:
            self.close()
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
            try:
                size = os.fstat(fd).st_size
                if size < nbytes:
                    raise OSError(f"{size} bytes where the request needs {nbytes}")
                self._map = _map(fd, size)
            finally:
                os.close(fd)
            self.path, self.view = path, memoryview(self._map)
        return self.view

    def close(self) -> None:
        self.view.release()
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
        self.path, self._map, self.view = None, None, memoryview(b"")


def _serve(conn: Connection, request_id: str, kind: int, shm_path: str, files: Sequence[FileRequest],
           namespace: bytes, layout: bytes, size: int, shared: _Mapping) -> None:
    try:
        view = shared.of(shm_path, len(files) * size)
    except OSError as exc:  # removed under the engine side (which then makes a new one), or not grown
        conn.send((request_id, [(0, SHARED_MEMORY, str(exc), 0, 0.0, 0.0)], True))
        return
    batch: list[Outcome] = []
    ahead = _ReadAhead([path for path, _, _ in files])
    try:
        for i, (_, block_hash, token_bytes) in enumerate(files):
            outcome = _read_one(ahead, i, kind, block_hash, token_bytes, view[i * size:(i + 1) * size], namespace,
                                layout, size)
            batch.append((i, *outcome))
            if outcome[0] != OK:
                break
            if len(batch) == BATCH_FILES:
                conn.send((request_id, batch, False))
                batch = []
    finally:
        ahead.close()
    conn.send((request_id, batch, True))


class _ReadAhead:
    """A request's files opened, checked (`open_store_file`) and handed to the kernel to read
    (`POSIX_FADV_WILLNEED`) all before the first is read: the disk then has every read queued at
    once, and one open and fstat a file serve both the advice and the read. Timed on a cold 16K-token
    hit's 128 files: a thread advising beside the reads (each file opened twice) 6.1 ms; advising 16,
    64 or 128 files ahead of the one read, 13.1, 8.9 and 6.6 ms (an advice waits while the disk's
    queue is full, and the read behind it with it); all first, 5.5. No more than MAX_OPEN_FILES
    descriptors stay open: the files past them are advised, closed, and opened again to be read.
    Advising stops at the first file that cannot be opened: the run of good files ends there."""

    def __init__(self, paths: Sequence[str]) -> None:
        self._paths = paths
        self._opened: dict[int, tuple[int, int] | BaseException] = {}
        for i, path in enumerate(paths):
            opened = self._open(path)
            if isinstance(opened, BaseException) or i < MAX_OPEN_FILES:
                self._opened[i] = opened
            else:
                os.close(opened[0])
            if isinstance(opened, BaseException):
                break

    def take(self, i: int) -> tuple[int, int]:
        """File i's (descriptor, size), now the caller's to close; raises what opening it raised."""
        opened = self._opened.pop(i, None)
        if opened is None:
            fd_size = open_store_file(self._paths[i])  # past MAX_OPEN_FILES: advised, then closed
            return fd_size
        if isinstance(opened, BaseException):
            raise opened
        return opened

    @staticmethod
    def _open(path: str) -> tuple[int, int] | BaseException:
        try:
            fd, file_size = open_store_file(path)
        except (OSError, StoreFileError) as exc:
            return exc
        if hasattr(os, "posix_fadvise"):
            with contextlib.suppress(OSError):  # a hint: one that fails changes nothing
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
        return fd, file_size

    def close(self) -> None:
        """Close what was opened and not taken (the request ended early)."""
        for opened in self._opened.values():
            if not isinstance(opened, BaseException):
                os.close(opened[0])
        self._opened.clear()


def _read_one(ahead: _ReadAhead, i: int, kind: int, block_hash: bytes, token_bytes: bytes | None, slot: memoryview,
              namespace: bytes, layout: bytes, size: int) -> tuple[str, str, int, float, float]:
    t0 = time.perf_counter()
    try:
        fd, file_size = ahead.take(i)
    except FileNotFoundError:
        return MISSING, "", 0, 0.0, 0.0
    except OSError as exc:
        return "unreadable", str(exc) or type(exc).__name__, 0, 0.0, 0.0
    except StoreFileError as exc:
        return exc.kind, str(exc), 0, 0.0, 0.0
    try:
        data = read_opened(fd, file_size, kind, layout, size, None, slot)
    except (OSError, MemoryError) as exc:
        return "unreadable", str(exc) or type(exc).__name__, 0, 0.0, 0.0
    except StoreFileError as exc:
        return exc.kind, str(exc), 0, 0.0, 0.0
    finally:
        os.close(fd)
    t1 = time.perf_counter()
    try:
        decode(data, kind, namespace, block_hash, token_bytes, layout, size, slot)
    except StoreFileError as exc:
        return exc.kind, str(exc), 0, 0.0, 0.0
    return OK, "", len(data) + size, t1 - t0, time.perf_counter() - t1


def shm_leftovers() -> list[Path]:
    """This process's shared-memory files present (tests: one per open store that has read, none once
    closed)."""
    return sorted(Path(_SHM_DIR).glob(f"{_SHM_PREFIX}{os.getpid()}-*"))
