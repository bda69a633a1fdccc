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

import os
import socket
import struct
import time
import uuid
from collections.abc import Sequence

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
ERROR_KINDS = ("truncated", "checksum", "namespace", "collision", "format", "unreadable", "timeout", "enospc",
               "write")


class StoreFileError(Exception):
    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def encode(kind: int, namespace: bytes, block_hash: bytes, tokens: Sequence[int], layout: bytes,
           payload: Sequence[bytes | memoryview]) -> list[bytes | memoryview]:
    """The file's pieces in order (header, token ids, layout, payload parts, CRC)."""
    length = sum(len(p) for p in payload)
    head = _HEAD.pack(MAGIC, FORMAT_VERSION, kind, namespace, block_hash, len(tokens), len(layout), length)
    token_bytes = struct.pack(f"<{len(tokens)}i", *tokens)
    return [head, token_bytes, layout, *payload, _CRC.pack(checksum((head, token_bytes, layout, *payload)))]


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


def decode(data: bytes | bytearray, kind: int, namespace: bytes, block_hash: bytes, tokens: Sequence[int] | None,
           layout: bytes, payload_bytes: int, payload: memoryview | None = None) -> memoryview:
    """Check a whole file's bytes and return its payload; raises StoreFileError naming the fault.
    Given `payload`, the file was read apart: its payload into `payload` (a row of the buffer it is
    loaded into) and everything else, in order, into `data`."""
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
    stored_tokens = struct.unpack_from(f"<{n_tok}i", data, _HEAD.size)
    if tokens is not None and tuple(stored_tokens) != tuple(tokens):
        raise StoreFileError("collision", "same hash, different tokens")
    if bytes(view[offset:offset + n_layout]) != layout:
        raise StoreFileError("namespace", "another KV layout")
    if n_payload != payload_bytes:
        raise StoreFileError("format", f"a payload of {n_payload} bytes where the layout needs {payload_bytes}")
    return payload if payload is not None else view[offset + n_layout:body]


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
