"""The SSD store's reader process (`cache/ssd_reader.py`): faults reach it through the files on disk and
through signals, since it runs in an interpreter of its own. Every one is a miss from the bad file on,
counted, and a dead or stuck reader is replaced: never a crash or a hang."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from tests.daemon import PATIENCE, wait_until
from v4serve.cache.ssd_file import FOOTER_BYTES, HEADER_BYTES, KIND_BLOCK, KIND_SNAPSHOT
from v4serve.cache.ssd_reader import shm_leftovers
from v4serve.cache.ssd_store import SSDStore

SIZE = 4096


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


def test_reads_in_the_reader_process_serve_every_payload_into_its_row(tmp_path: Path) -> None:
    store, items = _store(tmp_path, 8)
    try:
        assert _payloads(store, items) == [bytes([i + 1]) * SIZE for i in range(8)]
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(8)]
        file_bytes = HEADER_BYTES + 4 * 3 + len(b"layout") + SIZE + FOOTER_BYTES
        assert store.stats.errors == {} and store.stats.bytes_read == 16 * file_bytes
        assert shm_leftovers() == []  # the shared memory goes with the read
    finally:
        store.close()
    assert store.reader is not None and store.reader.pid is None


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


def test_a_reader_killed_mid_read_is_a_miss_and_replaced(tmp_path: Path) -> None:
    store, items = _store(tmp_path, 4)
    assert store.reader is not None
    try:
        _payloads(store, items[:1])  # the child has started
        pid = store.reader.pid
        assert pid is not None
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
    finally:
        store.close()


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


def test_no_shared_memory_reads_in_this_process(tmp_path: Path, monkeypatch) -> None:
    """/dev/shm full (a container's default is 64 MiB): the read falls back to this process's threads."""
    from v4serve.cache import ssd_store

    def full(*_: object) -> None:
        raise OSError(28, "No space left on device")

    store, items = _store(tmp_path, 3)
    monkeypatch.setattr(ssd_store, "SharedSlots", full)
    try:
        assert _payloads(store, items, into=True) == [bytes([i + 1]) * SIZE for i in range(3)]
        assert store.stats.errors == {}
    finally:
        store.close()


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
