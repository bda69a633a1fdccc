"""One SSD-store file: its bytes, every check a read makes before a byte is served, and the names of
the temp files it is written through. Plain Python, no torch.

A file is a header — magic, format version, kind (block or snapshot), namespace digest, chain hash,
token count, layout length, payload length — then the block's token ids (so a hash collision is a
miss, never wrong tokens), the layout descriptor, the payload and an XXH3-64 checksum of all of it
(~20 GB/s on one core: a hit's checksum costs a fraction of its read; zlib's CRC32 ran at ~1.7). A read
serves the payload only if every field is what the reader expects: the kind it asked for, its
namespace, hash, tokens and layout, and exactly the payload length its layout needs.
"""

from __future__ import annotations

import errno
import functools
import os
import socket
import stat
import struct
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import xxhash

MAGIC = b"V4KVSTOR"
FORMAT_VERSION = 2  # 2: XXH3-64 instead of CRC32 (a version-1 file is a miss)
# A sealed block; the slot state at a block boundary; the slot state and open block where a response ended.
KIND_BLOCK, KIND_SNAPSHOT, KIND_RESPONSE = 1, 2, 3
KIND_NAMES = {KIND_BLOCK: "block", KIND_SNAPSHOT: "snapshot", KIND_RESPONSE: "response-end"}
SUFFIX = {KIND_BLOCK: ".blk", KIND_SNAPSHOT: ".snap", KIND_RESPONSE: ".resp"}
# magic, version, kind, namespace, hash, token count, layout length, payload length
_HEAD = struct.Struct("<8sHB32s32sIIQ")
_CRC = struct.Struct("<Q")  # the checksum (XXH3-64); the name says where it sits, not which it is
# Every kind the store counts (`v4serve_kv_store_errors_total{kind}`, each series there at 0 from the start):
# a bad file's fault, a read past the timeout, a full disk, a failed write, a reader process that died.
ERROR_KINDS = ("truncated", "checksum", "namespace", "collision", "format", "unreadable", "timeout", "enospc",
               "write", "reader")


class StoreFileError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def encode(kind: int, namespace: bytes, block_hash: bytes, tokens: Sequence[int], layout: bytes,
           payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The file's pieces in order (header, token ids, layout, payload parts, CRC)."""
    length = sum(len(p) for p in payload)
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, kind, namespace, block_hash, len(tokens), len(layout), length)
    token_bytes = pack_tokens(tokens)
    return [head, token_bytes, layout, *payload, _CRC.pack(checksum((head, token_bytes, layout, *payload)))]


def pack_tokens(tokens: Sequence[int]) -> bytes:
    """Token ids as a file stores them (little-endian int32): what `decode` compares a file's with."""
    return _tokens_struct(len(tokens)).pack(*tokens)


@functools.lru_cache(maxsize=64)
def _tokens_struct(n: int) -> struct.Struct:
    return struct.Struct(f"<{n}i")


def checksum(parts: Sequence[bytes | bytearray | memoryview]) -> int:
    """XXH3-64 of the parts in order, as of their concatenation."""
    hasher = xxhash.xxh3_64()
    for part in parts:
        hasher.update(part)
    return hasher.intdigest()


HEADER_BYTES = _HEAD.size
FOOTER_BYTES = _CRC.size
# No file holds more token ids than this (a block holds block_size of them): a header claiming more is
# refused before a buffer of its size is allocated.
MAX_FILE_TOKENS = 1 << 20


def expected_size(head: bytes | bytearray, file_size: int, layout: bytes, payload_bytes: int) -> int:
    """Check a file's header (its first HEADER_BYTES) against its size on disk and the reader's layout
    before anything more is read, and return the size to read: a file whose header claims another
    layout or payload length, or whose size is not the one its header implies, is refused here, so a
    huge or sparse file under a store name never costs a buffer of its size."""
    if len(head) < _HEAD.size or file_size < _HEAD.size + _CRC.size:
        raise StoreFileError("truncated", f"{file_size} bytes is shorter than a header")
    magic, version, _, _, _, n_tok, n_layout, n_payload = _HEAD.unpack_from(head)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise StoreFileError("format", f"not a v4serve store file (magic {magic!r}, version {version})")
    if n_layout != len(layout):
        raise StoreFileError("namespace", "another KV layout")
    if n_payload != payload_bytes or n_tok > MAX_FILE_TOKENS:
        raise StoreFileError("format", f"a header claiming {n_tok} tokens and a {n_payload}-byte payload where "
                                       f"the layout needs {payload_bytes}")
    size = _HEAD.size + 4 * n_tok + n_layout + n_payload + _CRC.size
    if file_size != size:
        raise StoreFileError("truncated" if file_size < size else "format",
                             f"{file_size} bytes, header says {size}")
    return size


def decode(data: bytes | bytearray, kind: int, namespace: bytes, block_hash: bytes,
           tokens: Sequence[int] | bytes | None, layout: bytes, payload_bytes: int,
           payload: memoryview | None = None) -> memoryview:
    """Check a whole file's bytes and return its payload; raises StoreFileError naming the fault.
    `tokens`: the ids the file must hold, or them as `pack_tokens` packs them (bytes: compared as they
    are), or None (not checked). Given `payload`, the file was read apart: its payload into `payload`
    (a row of the buffer it is loaded into) and everything else, in order, into `data`."""
    apart = len(payload) if payload is not None else 0
    size = len(data) + apart
    if len(data) < _HEAD.size + _CRC.size:
        raise StoreFileError("truncated", f"{size} bytes is shorter than a header")
    magic, version, file_kind, ns, h, n_tok, n_layout, n_payload = _HEAD.unpack_from(data)
    if magic != MAGIC or version != FORMAT_VERSION:
        raise StoreFileError("format", f"not a v4serve store file (magic {magic!r}, version {version})")
    body = _HEAD.size + 4 * n_tok + n_layout + n_payload
    if size != body + _CRC.size or (payload is not None and n_payload != apart):
        fault = "truncated" if size < body + _CRC.size else "format"
        raise StoreFileError(fault, f"{size} bytes, header says {body + _CRC.size}")
    offset = _HEAD.size + 4 * n_tok
    view = memoryview(data)
    parts = [view[:body]] if payload is None else [view[:offset + n_layout], payload]
    if checksum(parts) != _CRC.unpack_from(data, body - apart)[0]:
        raise StoreFileError("checksum", "checksum mismatch")
    if file_kind != kind:
        found = KIND_NAMES.get(file_kind, f"kind {file_kind}")
        raise StoreFileError("format", f"a {found} file where a {KIND_NAMES[kind]} file belongs")
    if ns != namespace:
        raise StoreFileError("namespace", "written for another model, KV dtype or layout")
    if h != block_hash:
        raise StoreFileError("collision", "the file holds another hash")
    if isinstance(tokens, bytes):
        same = view[_HEAD.size:offset] == tokens
    else:
        same = tokens is None or struct.unpack_from(f"<{n_tok}i", data, _HEAD.size) == tuple(tokens)
    if not same:
        raise StoreFileError("collision", "same hash, different tokens")
    if bytes(view[offset:offset + n_layout]) != layout:
        raise StoreFileError("namespace", "another KV layout")
    if n_payload != payload_bytes:
        raise StoreFileError("format", f"a payload of {n_payload} bytes where the layout needs {payload_bytes}")
    return payload if payload is not None else view[offset + n_layout:body]


# Reads from the page cache only, failing at once where the data is not there (Linux 4.14+).
_NOWAIT = getattr(os, "RWF_NOWAIT", 0)


def _read_into(fd: int, buffers: Sequence[bytearray | memoryview], on_cold: Callable[[], None] | None,
               offset: int = 0) -> int:
    """Bytes read into `buffers` in order from `offset` (fewer only at the end of the file). Given
    `on_cold`, what the page cache holds is read first without waiting, and `on_cold` is called before
    the rest is waited for (also where the file system cannot read without waiting: it cannot say)."""
    if on_cold is None or not _NOWAIT:
        if on_cold is not None:
            on_cold()
        return os.preadv(fd, buffers, offset)  # one call, no views made: the reader process's per-file path
    views = [memoryview(b).cast("B") for b in buffers if len(b)]
    total = sum(len(v) for v in views)
    if not total:
        return 0
    n = 0
    if on_cold is not None and _NOWAIT:
        try:
            n = os.preadv(fd, views, offset, _NOWAIT)
        except BlockingIOError:
            pass
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                raise
        if n >= total:
            return n
    if on_cold is not None:
        on_cold()
    return n + os.preadv(fd, _after(views, n), offset + n)


def _after(views: list[memoryview], skip: int) -> list[memoryview]:
    """`views` without their first `skip` bytes."""
    rest = []
    for v in views:
        if skip >= len(v):
            skip -= len(v)
        else:
            rest.append(v[skip:])
            skip = 0
    return rest


def will_need(path: str | Path) -> bool:
    """Ask the kernel to start reading a file now (a hint: one that fails changes nothing); False when
    it cannot be opened (a missing file ends a prefix anyway)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
    except OSError:
        pass
    finally:
        os.close(fd)
    return True


def read_store_file(path: str | Path, kind: int, layout: bytes, payload_bytes: int,
                    on_cold: Callable[[], None] | None = None, into: memoryview | None = None) -> bytearray:
    """A store file's bytes, read by the rules (`open_store_file`, `read_opened`). The store's reads
    and its reader process's (`ssd_reader`) go through these."""
    fd, file_size = open_store_file(path)
    try:
        return read_opened(fd, file_size, kind, layout, payload_bytes, on_cold, into)
    finally:
        os.close(fd)


def open_store_file(path: str | Path) -> tuple[int, int]:
    """(descriptor, size) of a store file opened for reading: never through a symlink (O_NOFOLLOW), never
    a FIFO or device (non-blocking open, regular files only). The caller closes the descriptor."""
    # Plain descriptor calls: a buffered file object cost more than the read of a 60 KB file.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise StoreFileError("unreadable", "not a regular file")
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def read_opened(fd: int, file_size: int, kind: int, layout: bytes, payload_bytes: int,
                on_cold: Callable[[], None] | None = None, into: memoryview | None = None) -> bytearray:
    """An opened store file's bytes (`open_store_file`), read only once its header and size say it is the
    exact size this layout's file has (`expected_size`), into a buffer of that size. Given `into`, the
    payload goes there and the rest of the file, in order, into the buffer returned."""
    apart = len(into) if into is not None else 0
    prefix = file_size - apart - FOOTER_BYTES
    if into is not None and HEADER_BYTES <= prefix <= HEADER_BYTES + 4 * MAX_FILE_TOKENS + len(layout):
        # The size a payload read apart implies (every block file's): one read, then the header's
        # checks on the bytes read (a bounded buffer either way), as below.
        data = bytearray(prefix + FOOTER_BYTES)
        n = _read_into(fd, [memoryview(data)[:prefix], into, memoryview(data)[prefix:]], on_cold)
        size = expected_size(data[:HEADER_BYTES], file_size, layout, payload_bytes)
        if n < size:
            raise StoreFileError("truncated", f"{n} bytes read where the file had {size}")
        return data
    head = bytearray(min(HEADER_BYTES, file_size))
    got = _read_into(fd, [head], on_cold)
    size = expected_size(head[:got], file_size, layout, payload_bytes)
    # Writable buffers: payload tensors are built on them without another copy.
    data = bytearray(size - apart)
    data[:got] = head[:got]
    if into is None:
        rest = [memoryview(data)[got:]]
    else:  # prefix | payload | checksum
        cut = size - apart - FOOTER_BYTES
        rest = [memoryview(data)[got:cut], into, memoryview(data)[cut:]]
    n = got + _read_into(fd, rest, on_cold, got)
    if n < size:
        raise StoreFileError("truncated", f"{n} bytes read where the file had {size}")
    return data


def file_tokens(data: bytes | bytearray | memoryview) -> tuple[int, ...]:
    """The token ids a file holds (its header must have been checked: `decode`)."""
    n_tok = _HEAD.unpack_from(data)[5]
    return struct.unpack_from(f"<{n_tok}i", data, _HEAD.size)


# ---- temp files: named after their writer, so a starting store never removes a live writer's ---------
_HOST = socket.gethostname().replace("-", "_")[:64] or "host"


def temp_name() -> str:
    return f".tmp-{_HOST}-{os.getpid()}-{uuid.uuid4().hex}"


def temp_is_stale(name: str, mtime: float, max_age: float, now: float | None = None) -> bool:
    """A temp file is left over if it is older than `max_age` seconds, if its writer was a process
    on this host that is gone, or if its name carries no writer at all (written before names did).
    A fresh one from a live process, or from another host, is someone's write in progress."""
    now = time.time() if now is None else now
    if now - mtime > max_age:
        return True
    parts = name.split("-")
    if len(parts) != 4 or not parts[2].isdigit():
        return True
    return parts[1] == _HOST and not _process_alive(int(parts[2]))


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True
