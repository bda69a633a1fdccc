"""The SSD store's reader process (`cache/ssd_reader.py`): faults reach it through the files on disk and
through signals, since it runs in an interpreter of its own. Every one is a miss from the bad file on,
counted, and a dead or stuck reader is replaced: never a crash or a hang."""

from __future__ import annotations

import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.daemon import PATIENCE, wait_until
from v4serve.cache import ssd_reader
from v4serve.cache.ssd_file import FOOTER_BYTES, HEADER_BYTES, KIND_BLOCK, KIND_SNAPSHOT
from v4serve.cache.ssd_reader import shm_leftovers
from v4serve.cache.ssd_store import SSDStore

SIZE = 4096
NewShm = Callable[[], list[Path]]


@pytest.fixture
def new_shm() -> NewShm:
    """This process's shared-memory files made since the test began (a store another test left open keeps
    its own until collected)."""
    before = set(shm_leftovers())
    return lambda: sorted(set(shm_leftovers()) - before)


def _store(tmp_path: Path, n: int, **kw) -> tuple[SSDStore, list[tuple[bytes, list[int]]]]:
    store = SSDStore(tmp_path, b"n" * 32, b"layout", {KIND_BLOCK: SIZE, KIND_SNAPSHOT: SIZE}, **kw)
    assert store.reader is not None
    items = [(bytes([i + 1]) * 32, [i, i + 1, i + 2]) for i in range(n)]
    for i, (h, toks) in enumerate(items):
        assert store.put(KIND_BLOCK, h, toks, [bytes([i + 1]) * SIZE])
    store.flush(timeout=PATIENCE)
    return store, items


def _payloads(store: SSDStore, items: list, into: bool = False) -> list[bytes]:
    rows = [memoryview(bytearray(SIZE)) for _ in items] if into else None
    return [bytes(p) for p in store.get_many(KIND_BLOCK, items, into=rows)]


def test_reads_in_the_reader_process_serve_every_payload_into_its_row(tmp_path: Path, new_shm: NewShm) -> None:
    store, items = _store(tmp_path, 8)
    try:
        assert _payloads(store, items) == [bytes([i + 1]) * SIZE for i in range(8)]
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(8)]
        file_bytes = HEADER_BYTES + 4 * 3 + len(b"layout") + SIZE + FOOTER_BYTES
        assert store.stats.errors == {} and store.stats.bytes_read == 16 * file_bytes
        assert new_shm() == [Path(store.reader.shm_path)]  # one file, kept for the next read
    finally:
        store.close()
    assert store.reader is not None and store.reader.pid is None
    assert new_shm() == [] and store.reader.shm_path is None  # the shared memory goes with the store


@pytest.mark.parametrize("fault", ["truncated", "checksum", "collision", "symlink", "fifo"])
def test_a_bad_file_is_a_quarantined_miss_from_there_on(tmp_path: Path, fault: str) -> None:
    store, items = _store(tmp_path, 5)
    path = store.path(KIND_BLOCK, items[2][0])
    if fault == "truncated":
        os.truncate(path, path.stat().st_size - 10)
    elif fault == "checksum":
        with open(path, "r+b") as f:
            f.seek(path.stat().st_size - 100)
            f.write(b"\xff")
    elif fault == "symlink":
        target = tmp_path / "elsewhere"
        os.replace(path, target)
        path.symlink_to(target)
    elif fault == "fifo":
        path.unlink()
        os.mkfifo(path)
    asked = list(items)
    if fault == "collision":
        asked[2] = (items[2][0], [9, 9, 9])  # same hash, other tokens
    try:
        assert _payloads(store, asked, into=True) == [bytes([i + 1]) * SIZE for i in range(2)]
        assert sum(store.stats.errors.values()) == 1
        assert not path.exists() and len(list(store.quarantine.iterdir())) == 1
        assert _payloads(store, items[3:]) == [bytes([i + 1]) * SIZE for i in range(3, 5)]  # the reader lives on
    finally:
        store.close()


def test_a_file_deleted_between_lookup_and_read_is_a_miss(tmp_path: Path) -> None:
    store, items = _store(tmp_path, 4)
    try:
        assert store.longest_prefix([h for h, _ in items]) == 4
        store.path(KIND_BLOCK, items[1][0]).unlink()  # another daemon's eviction, say
        assert _payloads(store, items) == [bytes([1]) * SIZE]
        assert store.stats.errors == {} and not store.contains(KIND_BLOCK, items[1][0])
    finally:
        store.close()


def test_a_reader_killed_mid_read_is_a_miss_and_replaced(tmp_path: Path, new_shm: NewShm) -> None:
    store, items = _store(tmp_path, 4)
    assert store.reader is not None
    try:
        _payloads(store, items[:1])  # the child has started
        pid, shm = store.reader.pid, store.reader.shm_path
        assert pid is not None and shm is not None
        os.kill(pid, signal.SIGSTOP)  # holds the request until the kill below
        conn, sent = store.reader._conn, threading.Event()

        class Told:  # the reader's connection, telling the test once the request is on its way
            def __getattr__(self, name: str) -> object:
                return getattr(conn, name)

            def send(self, message: object) -> None:
                conn.send(message)
                sent.set()

        store.reader._conn = Told()  # type: ignore[assignment]
        got: list[list[bytes]] = []
        reading = threading.Thread(target=lambda: got.append(_payloads(store, items)))
        reading.start()
        wait_until(sent.is_set, "the read's request to reach the stopped reader")
        os.kill(pid, signal.SIGKILL)
        reading.join(PATIENCE)
        assert not reading.is_alive() and got == [[]]
        assert store.stats.errors == {"reader": 1}
        assert _payloads(store, items) == [bytes([i + 1]) * SIZE for i in range(4)]  # a new reader
        assert store.reader.pid != pid and store.reader.restarts == 1
        assert new_shm() == [Path(shm)] and store.reader.shm_path == shm  # seen to exit: its memory reused
    finally:
        store.close()
    assert new_shm() == []


def test_a_stuck_reader_is_a_timed_out_miss_and_replaced(tmp_path: Path) -> None:
    store, items = _store(tmp_path, 3, read_timeout=0.5)
    assert store.reader is not None
    try:
        _payloads(store, items[:1])
        pid = store.reader.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)  # a hung file system, as far as the engine can tell
        t0 = time.monotonic()
        assert _payloads(store, items) == []
        assert time.monotonic() - t0 < PATIENCE and store.stats.errors == {"timeout": 1}
        assert _payloads(store, items) == [bytes([i + 1]) * SIZE for i in range(3)]
        assert store.reader.pid != pid
    finally:
        store.close()


def test_the_in_process_path_serves_the_same_bytes(tmp_path: Path) -> None:
    """`read_process=False` (what tests that patch this process's reads select) reads the same files
    to the same payloads."""
    store, items = _store(tmp_path, 4)
    store.close()
    again = SSDStore(tmp_path, b"n" * 32, b"layout", {KIND_BLOCK: SIZE, KIND_SNAPSHOT: SIZE}, read_process=False)
    try:
        assert again.reader is None
        assert _payloads(again, items, into=True) == [bytes([i + 1]) * SIZE for i in range(4)]
    finally:
        again.close()


def test_no_shared_memory_reads_in_this_process(tmp_path: Path, monkeypatch, new_shm: NewShm) -> None:
    """/dev/shm full (a container's default is 64 MiB): the read falls back to this process's threads,
    and reads go through the reader again once there is room."""
    allocate = ssd_reader.SharedSlots._allocate

    def full(fd: int, nbytes: int) -> object:
        raise OSError(28, "No space left on device")

    store, items = _store(tmp_path, 3)
    assert store.reader is not None
    monkeypatch.setattr(ssd_reader.SharedSlots, "_allocate", staticmethod(full))
    try:
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(3)]
        assert store.stats.errors == {} and store.reader.shm_path is None and new_shm() == []
        monkeypatch.setattr(ssd_reader.SharedSlots, "_allocate", staticmethod(allocate))
        assert _payloads(store, items[:1]) == [bytes([1]) * SIZE]
        shm, slots = store.reader.shm_path, store.reader._slots
        assert shm is not None and slots is not None
        size = slots.nbytes  # one payload, to a whole page
        # Room for one payload, not for three: the bigger read is in this process, the file stays as it was.
        monkeypatch.setattr(ssd_reader.SharedSlots, "_allocate",
                            staticmethod(lambda fd, n: allocate(fd, n) if n <= SIZE else full(fd, n)))
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(3)]
        assert store.reader.shm_path == shm and store.reader._slots is slots
        assert slots.nbytes == size and store.reader.restarts == 0
        assert _payloads(store, items[1:2]) == [bytes([2]) * SIZE]  # what fits still goes through the reader
        assert store.stats.errors == {}
    finally:
        store.close()
    assert new_shm() == []


def test_a_read_after_close_is_a_miss_and_starts_no_reader(tmp_path: Path) -> None:
    """A load still running as the engine closes gets a miss, not a new child process."""
    store, items = _store(tmp_path, 2)
    store.close()
    assert store.reader is not None
    assert _payloads(store, items) == [] and store.reader.pid is None


def test_rows_are_filled_in_order_whether_or_not_they_follow_one_another() -> None:
    from v4serve.cache.ssd_reader import copy_rows_without_the_gil

    buffer = memoryview(bytearray(3 * 4))
    rows = [buffer[0:4], buffer[4:8], memoryview(bytearray(4)), buffer[8:12]]  # one run, one apart, one more
    copy_rows_without_the_gil(rows, memoryview(bytearray(range(16))))  # writable, as shared memory is
    assert [bytes(r) for r in rows] == [bytes(range(i, i + 4)) for i in range(0, 16, 4)]
    with pytest.raises(ValueError):
        copy_rows_without_the_gil(rows, memoryview(bytearray(15)))


def _inode(path: str | None) -> int:
    assert path is not None
    return os.stat(path).st_ino


def test_reads_reuse_one_shared_memory_file_grown_never_shrunk(tmp_path: Path, new_shm: NewShm) -> None:
    """One /dev/shm file for every read (allocated and faulted in once, not per hit): the same name and
    inode read after read, grown in place for a bigger read and kept at that size for smaller ones."""
    store, items = _store(tmp_path, 40)
    assert store.reader is not None and store.reader.shm_path is None  # nothing allocated before a read
    want = [bytes([i + 1]) * SIZE for i in range(40)]
    try:
        assert _payloads(store, items[:4]) == want[:4]
        shm = store.reader.shm_path
        inode = _inode(shm)
        assert _payloads(store, items[4:8], into=True) == want[4:8]  # other files into the same slots
        assert (store.reader.shm_path, _inode(shm)) == (shm, inode)
        assert _payloads(store, items, into=True) == want  # ten times the payloads: grown in place
        assert (store.reader.shm_path, _inode(shm)) == (shm, inode)
        assert store.reader._slots is not None
        grown = store.reader._slots.nbytes
        assert grown >= 40 * SIZE and os.stat(shm).st_size == grown
        assert _payloads(store, items[1:3]) == want[1:3]
        assert store.reader._slots.nbytes == grown and new_shm() == [Path(shm)]
        assert store.reader.restarts == 0 and store.stats.errors == {}
    finally:
        store.close()
    assert new_shm() == []


def test_an_earlier_reads_payloads_are_never_taken_for_this_ones(tmp_path: Path) -> None:
    """The slots still hold what the last read left there; only what the child reported good for this
    request (in file order) is taken: a bad file ends the prefix even with a valid payload in its slot."""
    store, items = _store(tmp_path, 6)
    assert store.reader is not None
    want = [bytes([i + 1]) * SIZE for i in range(6)]
    try:
        assert _payloads(store, items) == want  # slot i: payload i + 1
        path = store.path(KIND_BLOCK, items[2][0])
        with open(path, "r+b") as f:  # file 2's checksum no longer matches (its slot keeps payload 3)
            f.seek(path.stat().st_size - 100)
            f.write(b"\xff")
        assert _payloads(store, items, into=True) == want[:2]
        store.path(KIND_BLOCK, items[4][0]).unlink()
        assert _payloads(store, items[3:]) == want[3:4]  # slot 1 still holds payload 2: not taken
        assert store.stats.errors == {"checksum": 1}
    finally:
        store.close()


def test_outcomes_out_of_file_order_are_a_miss_never_a_wrong_payload(tmp_path: Path) -> None:
    """A reply that skips a file (so a slot would be taken for another file's payload) ends the read."""
    store, items = _store(tmp_path, 4)
    assert store.reader is not None
    try:
        _payloads(store, items[:1])
        conn = store.reader._conn

        class SkipsOne:  # the reader's connection, losing the first file of the next reply
            def __getattr__(self, name: str) -> object:
                return getattr(conn, name)

            def recv(self) -> object:
                request_id, outcomes, done = conn.recv()
                return request_id, outcomes[1:], done

        store.reader._conn = SkipsOne()  # type: ignore[assignment]
        assert _payloads(store, items) == []
        assert store.stats.errors == {"reader": 1}
        assert _payloads(store, items) == [bytes([i + 1]) * SIZE for i in range(4)]  # a new reader
    finally:
        store.close()


def test_a_child_not_seen_to_exit_takes_its_shared_memory_with_it(tmp_path: Path, monkeypatch, new_shm: NewShm) -> None:
    """A child ended but not reaped (stuck in the kernel) may still write into its mapping: the next read
    gets a file of its own, and the old one is removed."""
    store, items = _store(tmp_path, 3, read_timeout=0.5)
    assert store.reader is not None
    try:
        _payloads(store, items[:1])
        proc, shm = store.reader._proc, store.reader.shm_path
        assert proc is not None and shm is not None
        os.kill(proc.pid, signal.SIGSTOP)  # never answers: the read times out and the child is killed

        def not_yet(timeout: float | None = None) -> int:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0)

        monkeypatch.setattr(proc, "wait", not_yet)
        assert _payloads(store, items) == [] and store.stats.errors == {"timeout": 1}
        assert store.reader.shm_path is None and not os.path.exists(shm)
        monkeypatch.undo()
        assert _payloads(store, items) == [bytes([i + 1]) * SIZE for i in range(3)]
        assert store.reader.shm_path not in (None, shm) and new_shm() == [Path(store.reader.shm_path)]
        proc.wait(PATIENCE)
    finally:
        store.close()
    assert new_shm() == []


def test_a_starting_store_removes_shared_memory_of_engines_that_are_gone(tmp_path: Path) -> None:
    """A crashed engine's `v4serve-read-<pid>-<id>` file is removed by the next store that starts; a live
    process's (this one's, another's), one a live engine holds locked whatever its pid says (an engine in
    another pid namespace sharing /dev/shm) and any other name are kept."""
    live = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    dead = None
    for _ in range(20):  # a pid nobody has: a child's, once reaped (unless taken again at once)
        child = subprocess.Popen([sys.executable, "-c", "pass"])
        child.wait(PATIENCE)
        try:
            os.kill(child.pid, 0)
        except ProcessLookupError:
            dead = child.pid
            break
    assert dead is not None
    folder = Path(ssd_reader._SHM_DIR)
    crashed = folder / f"v4serve-read-{dead}-{uuid.uuid4().hex}"
    locked = folder / f"v4serve-read-{dead}-{uuid.uuid4().hex}"
    kept = [folder / f"v4serve-read-{os.getpid()}-{uuid.uuid4().hex}",
            folder / f"v4serve-read-{live.pid}-{uuid.uuid4().hex}", locked,
            folder / f"v4serve-read-{dead}-not-a-read", folder / f"v4serve-read-{dead}-{uuid.uuid4().hex}.x"]
    store, holder = None, None
    try:
        for path in [crashed, *kept]:
            path.write_bytes(b"x")
        holder = os.open(locked, os.O_RDONLY)
        fcntl.flock(holder, fcntl.LOCK_SH)  # as a live `SharedSlots` holds its file
        store, _ = _store(tmp_path, 0)
        assert not crashed.exists() and all(path.exists() for path in kept)
        os.close(holder)
        holder = None
        assert locked.name in ssd_reader.sweep_shm_leftovers() and not locked.exists()  # its holder gone, so is it
    finally:
        if holder is not None:
            os.close(holder)
        if store is not None:
            store.close()
        for path in [crashed, *kept]:
            path.unlink(missing_ok=True)
        assert live.stdin is not None
        live.stdin.close()
        live.wait(PATIENCE)


def test_shared_memory_removed_under_the_store_is_made_again(tmp_path: Path, monkeypatch, new_shm: NewShm) -> None:
    """/dev/shm cleaned under a live engine (systemd's RemoveIPC, an operator): the next read makes a new
    file; a child that cannot map the file it is sent is a reader fault, never a quarantined block file."""
    store, items = _store(tmp_path, 3)
    assert store.reader is not None
    want = [bytes([i + 1]) * SIZE for i in range(3)]
    try:
        assert _payloads(store, items) == want
        first = store.reader.shm_path
        assert first is not None
        os.unlink(first)
        assert _payloads(store, items, into=True) == want
        second = store.reader.shm_path
        assert second not in (None, first) and new_shm() == [Path(second)]
        # Gone again, this time unseen (as if between the check and the request), to a new child.
        assert store.reader._slots is not None
        monkeypatch.setattr(store.reader._slots, "present", lambda: True)
        os.unlink(second)
        store.reader._stop()
        assert _payloads(store, items) == [] and store.stats.errors == {"reader": 1}
        assert not store.quarantine.exists() and store.longest_prefix([h for h, _ in items]) == 3
        assert _payloads(store, items) == want and store.reader.shm_path not in (None, first, second)
    finally:
        store.close()
    assert new_shm() == []


def _mapped_by(pid: int | None, path: str) -> bool:
    assert pid is not None
    with open(f"/proc/{pid}/maps") as f:
        return any(line.rstrip().endswith(path) for line in f)


def test_a_reserve_makes_and_maps_the_shared_memory_before_any_read(tmp_path: Path, monkeypatch,
                                                                    new_shm: NewShm) -> None:
    """`read_reserve`: the shared memory is made at start, as large as asked up to RESERVE_CAP, and the
    child has it mapped before the first read, which then neither grows nor maps it again."""
    monkeypatch.setattr(ssd_reader, "RESERVE_CAP", 6 * SIZE)
    store, items = _store(tmp_path, 5, read_reserve=100 * SIZE)  # capped: 6 payloads
    assert store.reader is not None
    try:
        wait_until(lambda: not any(t.name == "v4serve-ssd-reserve" for t in threading.enumerate()), "the reserve")
        slots, shm = store.reader._slots, store.reader.shm_path
        assert shm is not None and _mapped_by(store.reader.pid, shm)  # the child has it mapped
        assert slots is not None and slots.nbytes == 6 * SIZE and new_shm() == [Path(shm)]
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(5)]
        assert store.reader._slots is slots and slots.nbytes == 6 * SIZE and store.reader.restarts == 0
    finally:
        store.close()
    assert new_shm() == []


def test_no_reserve_without_room_and_reads_still_served(tmp_path: Path, monkeypatch, new_shm: NewShm) -> None:
    """/dev/shm without room for the reserve: nothing is made at start, and the first read makes what it
    needs (or reads in this process), as without a reserve."""
    def full(fd: int, nbytes: int) -> object:
        raise OSError(28, "No space left on device")

    allocate = ssd_reader.SharedSlots._allocate
    monkeypatch.setattr(ssd_reader.SharedSlots, "_allocate", staticmethod(full))
    store, items = _store(tmp_path, 3, read_reserve=3 * SIZE)
    assert store.reader is not None
    try:
        wait_until(lambda: not any(t.name == "v4serve-ssd-reserve" for t in threading.enumerate()), "the reserve")
        assert store.reader.shm_path is None and new_shm() == []
        monkeypatch.setattr(ssd_reader.SharedSlots, "_allocate", staticmethod(allocate))
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(3)]
        assert store.reader.shm_path is not None and store.stats.errors == {}
    finally:
        store.close()


def _open_fds(folder: Path) -> int:
    """This process's descriptors open on files in `folder` (other threads' descriptors do not count)."""
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}").startswith(f"{folder}/")
        except OSError:  # closed meanwhile
            pass
    return count


def test_the_child_advises_a_requests_files_first_with_a_bounded_number_open(tmp_path: Path, monkeypatch) -> None:
    """`_ReadAhead` (in this interpreter, as the child runs it): every file is opened and advised before
    the first is read, no more than MAX_OPEN_FILES stay open (the rest are opened again to be read), a
    file that cannot be opened ends the advising there, and what was not taken is closed."""
    monkeypatch.setattr(ssd_reader, "MAX_OPEN_FILES", 2)
    paths = []
    for i in range(5):
        path = tmp_path / f"f{i}"
        path.write_bytes(bytes([i]) * (i + 1))
        paths.append(str(path))
    ahead = ssd_reader._ReadAhead(paths)
    assert _open_fds(tmp_path) == 2
    for i in range(5):
        fd, size = ahead.take(i)
        try:
            assert size == i + 1 and os.pread(fd, 16, 0) == bytes([i]) * (i + 1)
        finally:
            os.close(fd)
    ahead.close()
    assert _open_fds(tmp_path) == 0
    os.unlink(paths[1])
    ahead = ssd_reader._ReadAhead(paths)
    assert _open_fds(tmp_path) == 1  # file 0; advising stopped at the missing file 1
    ahead.close()
    assert _open_fds(tmp_path) == 0
    ahead = ssd_reader._ReadAhead(paths)
    os.close(ahead.take(0)[0])
    with pytest.raises(FileNotFoundError):
        ahead.take(1)
    ahead.close()
    assert _open_fds(tmp_path) == 0
