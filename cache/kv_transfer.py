"""Prefill and decode on separate replicas: a prompt's KV handed from the replica that computed it to
the one that decodes it. Plain Python, no torch.

What is handed over is what a prefix hit reads: the prompt's sealed blocks and the slot's state just
before its last token (a sealed snapshot at a block boundary, else a response end with its open
block), as SSD-store files. The prefill replica links them into `handover/<id>/` of its store with a
manifest (`SSDStore.hand_over`); the decode replica gets the files it lacks and writes them into its
own store, where its ordinary disk-hit path finds them. How the files travel:

- **Shared store** (both replicas mount the same `--kv-store-dir`): the manifest is on the decode
  replica's own disk. A file the two stores share by name is not copied at all.
- **Otherwise, over TCP**: the decode replica asks the prefill replica's HTTP server for the manifest
  (`GET /v4serve/kv_transfer/{id}`), then for the files it lacks, streamed back to back in one reply
  (`POST /v4serve/kv_transfer/{id}/files`), and releases the hand-over once done (`DELETE`). Every
  request and answer is proven with the fleet's peer secret (`peer_auth`).

Who is trusted with what: a decode replica fetches only from the producers its operator listed
(`kv_connector_extra_config.producers`); a request's `kv_transfer_params` can pick one of them, never add
one. And it imports only what its own request implies: the hand-over must be the hash chain of that
request's prompt tokens under that request's root (its tenant's scope), block by block, with the
tokens in every file (blocks, snapshot, response end) equal to the prompt's, each file exactly the size
its kind has, checked as a store read checks it — before anything is written where another request
could read it. Anything else is a fallback, counted, and never stored: a transfer can make a hit shorter,
never wrong. What a listed producer could still get wrong is the KV values themselves (a replica with
the secret computing garbage for the right tokens): that is trusting the operator's own replicas, as a
shared store trusts whoever can write to it, not trusting a client.

Reads from a peer are bounded: the manifest in entries (the prompt's blocks + 1) and bytes, each file by
the exact size its kind has (checked before it is read), the whole fetch by one deadline
(`fetch_timeout`, from the moment the request asked) enforced on the socket itself, and fetches by a pool
of `max_fetches` threads.
"""

from __future__ import annotations

import contextlib
import hmac
import http.client
import json
import logging
import math
import os
import queue
import re
import shutil
import socket
import threading
import time
import uuid
from array import array
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from v4serve.cache.block_pool import chain_hash
from v4serve.cache.peer_auth import (
    MAC_BYTES,
    MIN_SECRET_BYTES,
    PEER_HEADER,
    REPLY_HEADER,
    PeerRefused,
    check_reply,
    file_mac,
    request_proof,
)
from v4serve.cache.ssd_file import (
    KIND_BLOCK,
    KIND_RESPONSE,
    KIND_SNAPSHOT,
    SUFFIX,
    StoreFileError,
    open_store_file,
    pack_tokens,
    read_store_file,
)
from v4serve.cache.ssd_store import MANIFEST, SSDStore

log = logging.getLogger(__name__)

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTOR = "V4ServeConnector"
# vLLM's keys that mean nothing for a hand-over over HTTP or a shared store: accepted, not used.
VLLM_IGNORED = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_connector_module_path",
                "enable_permute_local_kv")
TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
PATH = "/v4serve/kv_transfer/"  # + id (the manifest; DELETE releases it), + id + "/files" (the files asked for)
FALLBACK_REASONS = ("unreachable", "timeout", "refused", "corrupt", "incomplete", "store", "unlisted",
                    "unauthenticated", "unverified")
SECRET_ENV = "V4SERVE_KV_PEER_SECRET"
# Old settings, named where they are refused.
REPLACED = {"peer_api_key": "peer_secret (hand-overs are proven with a secret of their own, not an API key)",
            "trusted_producers": "producers (every producer a decode replica fetches from is listed)"}
# A manifest entry's JSON is ~200 bytes, a response end's tail up to ~8 bytes a token.
MANIFEST_BYTES_PER_ENTRY = 512
MANIFEST_BASE_BYTES = 4096
RELEASE_SECONDS = 2.0  # at most this of what is left of the deadline goes to releasing a fetched hand-over


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config`, vLLM's JSON shape: `{"kv_connector": "V4ServeConnector", "kv_role":
    "kv_producer" | "kv_consumer" | "kv_both", "kv_ip", "kv_port", "engine_id",
    "kv_connector_extra_config": {"producers", "peer_secret" | "peer_secret_file", "hold_seconds",
    "fetch_timeout", "max_fetches"}}`; the peer secret may come from $V4SERVE_KV_PEER_SECRET instead."""

    kv_role: str
    kv_connector: str = CONNECTOR
    engine_id: str = ""
    kv_ip: str | None = None  # where decode replicas reach this one (default: its --host, if not a wildcard)
    kv_port: int | None = None  # default: its --port
    kv_load_failure_policy: str = "recompute"  # vLLM's: a failed load is computed instead
    hold_seconds: float = 120.0  # a hand-over nobody fetched is dropped after this
    fetch_timeout: float = 30.0  # one deadline for a whole fetch, from the request's arrival (what arrived is kept)
    # "host:port" of every prefill replica this (decode) replica fetches from, as they name themselves
    # (their kv_ip:kv_port, else --host:--port).
    producers: tuple[str, ...] = ()
    peer_secret: str | None = field(default=None, repr=False)  # the fleet's, on every replica; never a client's
    max_fetches: int = 8  # fetches running at once (more wait their turn, within their deadline)

    @property
    def producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @property
    def secret(self) -> bytes:
        assert self.peer_secret is not None  # `check` refuses a config without one
        return self.peer_secret.encode()

    def lists(self, host: str, port: int) -> bool:
        """Whether `host:port` is one of the producers this replica was configured with."""
        return producer_address(host, port) in {_normal(p) for p in self.producers}

    @classmethod
    def parse(cls, text: str, environ: dict[str, str] | None = None) -> KVTransferConfig:
        """The flag's JSON → a config; ValueError saying what is wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--kv-transfer-config is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise ValueError('--kv-transfer-config must be a JSON object, e.g. {"kv_role": "kv_producer"}')
        extra = raw.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        for name in VLLM_IGNORED:
            raw.pop(name, None)
        for old, new in REPLACED.items():
            if old in extra:
                raise ValueError(f"--kv-transfer-config: kv_connector_extra_config.{old} is replaced by {new}")
        own = {"hold_seconds", "fetch_timeout", "producers", "peer_secret", "peer_secret_file", "max_fetches"}
        known = {f.name for f in fields(cls)} - own
        unknown = sorted(set(raw) - known) + [f"kv_connector_extra_config.{k}" for k in sorted(set(extra) - own)]
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown keys {unknown}; known: {sorted(known | {*VLLM_IGNORED})} "
                             f"and kv_connector_extra_config's {sorted(own)}")
        if raw.get("kv_connector") is None:
            raw.pop("kv_connector", None)
        producers = extra.pop("producers", [])
        if not isinstance(producers, list) or not all(isinstance(p, str) and _ADDRESS.fullmatch(p) for p in producers):
            raise ValueError('--kv-transfer-config: producers must be a list of "host:port" (IPv6: "[::1]:8001")')
        extra["peer_secret"] = _secret(extra.pop("peer_secret", None), extra.pop("peer_secret_file", None),
                                       os.environ if environ is None else environ)
        config = cls(**raw, **extra, producers=tuple(producers))
        config.check()
        return config

    def check(self) -> None:
        if self.kv_connector != CONNECTOR:
            raise ValueError(f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not available: v4serve "
                             f"hands KV over itself ({CONNECTOR}: store files pulled over HTTP or read from a shared "
                             "store)")
        if self.kv_role not in ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(ROLES)}, got {self.kv_role!r}")
        if self.kv_load_failure_policy != "recompute":
            raise ValueError("--kv-transfer-config: kv_load_failure_policy must be 'recompute' (a failed fetch is "
                             "computed on the decode replica)")
        for name in ("hold_seconds", "fetch_timeout"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"--kv-transfer-config: {name} must be a positive number of seconds")
        if isinstance(self.max_fetches, bool) or not isinstance(self.max_fetches, int) or self.max_fetches < 1:
            raise ValueError("--kv-transfer-config: max_fetches must be a whole number of fetches, at least 1")
        if self.kv_port is not None and (isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int)
                                         or not 0 < self.kv_port < 65536):
            raise ValueError("--kv-transfer-config: kv_port must be a port number")
        for name in ("engine_id", "kv_ip", "peer_secret"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"--kv-transfer-config: {name} must be a string")
        if self.peer_secret is None or len(self.peer_secret.encode()) < MIN_SECRET_BYTES:
            raise ValueError(f"--kv-transfer-config: hand-overs are proven with the fleet's peer secret, at least "
                             f"{MIN_SECRET_BYTES} bytes, the same on every prefill and decode replica and held by no "
                             f"client: set ${SECRET_ENV}, or kv_connector_extra_config.peer_secret_file (a file "
                             "holding it) or peer_secret (e.g. `openssl rand -hex 32`)")
        if self.consumer and not self.producers:
            raise ValueError('--kv-transfer-config: a decode replica fetches only from the producers it lists: set '
                             'kv_connector_extra_config.producers, e.g. ["10.0.0.5:8001"] (each prefill replica\'s '
                             "kv_ip:kv_port, else its --host:--port)")


_ADDRESS = re.compile(r"(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9._-]+):(\d{1,5})")


def _normal(address: str) -> str:
    host, _, port = address.rpartition(":")
    return producer_address(host.strip("[]"), int(port))


def producer_address(host: str, port: int) -> str:
    """"host:port" as producers are compared (hosts without case, IPv6 in brackets)."""
    host = host.strip("[]").lower()
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _secret(given: Any, path: Any, environ: dict[str, str]) -> str | None:
    sources = [name for name, v in (("peer_secret", given), ("peer_secret_file", path),
                                    (f"${SECRET_ENV}", environ.get(SECRET_ENV))) if v]
    if len(sources) > 1:
        raise ValueError(f"--kv-transfer-config: the peer secret is given {len(sources)} ways ({', '.join(sources)}): "
                         "give one")
    if path:
        if not isinstance(path, str):
            raise ValueError("--kv-transfer-config: peer_secret_file must be a path")
        try:
            with open(path, "rb") as file:
                data = file.read(4097)
        except OSError as exc:
            raise ValueError(f"--kv-transfer-config: peer_secret_file {path}: {exc.strerror or exc}") from exc
        if len(data) > 4096:
            raise ValueError(f"--kv-transfer-config: peer_secret_file {path} is longer than a secret (4 KiB)")
        return data.decode("utf-8", "replace").strip() or None
    return given if given else environ.get(SECRET_ENV) or None


def new_transfer_id() -> str:
    return uuid.uuid4().hex


@dataclass(frozen=True)
class KVSource:
    """Where a decode replica gets a request's KV: a prefill replica's hand-over."""

    host: str
    port: int
    transfer_id: str
    # The hand-over may still be being made (SGLang's router sends both legs at once): the prefill replica
    # is asked to wait for it. vLLM's sends the decode leg once the prefill leg has answered.
    wait: bool = False


@dataclass(frozen=True)
class Entry:
    """A file a hand-over may hold, as the decode request's own prompt implies it."""

    kind: int
    key: bytes
    tokens: bytes  # the token ids the file must hold, packed as files store them
    parent: bytes | None  # a block's predecessor (None: the first), a response end's sealed block (or root)

    @property
    def name(self) -> str:
        return self.key.hex() + SUFFIX[self.kind]


@dataclass(frozen=True)
class ExpectedPrefix:
    """What a decode request's hand-over may hold, worked out on the decode replica from that request's
    own prompt under its own root (its tenant's scope): the chain's blocks below the hand-over point (the
    prompt's last token but one), then the state there."""

    root: bytes
    block_hashes: tuple[bytes, ...]  # of the sealed blocks below the point
    tokens: array  # the prompt's tokens below the point
    block_size: int

    @classmethod
    def of(cls, root: bytes, block_hashes: Sequence[bytes], prompt: Sequence[int], block_size: int) -> ExpectedPrefix:
        point = max(0, len(prompt) - 1)
        return cls(root, tuple(block_hashes[:point // block_size]), array("q", prompt[:point]), block_size)

    def entries(self) -> list[Entry]:
        b, point, hashes = self.block_size, len(self.tokens), self.block_hashes
        out = [Entry(KIND_BLOCK, h, pack_tokens(self.tokens[i * b:(i + 1) * b]), hashes[i - 1] if i else None)
               for i, h in enumerate(hashes)]
        sealed = len(hashes)
        if point and point % b == 0:
            out.append(Entry(KIND_SNAPSHOT, hashes[-1], pack_tokens(self.tokens[point - b:point]), None))
        elif point:
            parent, tail = hashes[-1] if sealed else self.root, self.tokens[sealed * b:point]
            out.append(Entry(KIND_RESPONSE, chain_hash(parent, tail), pack_tokens(tail), parent))
        return out

    def manifest_limit(self) -> int:
        return MANIFEST_BASE_BYTES + MANIFEST_BYTES_PER_ENTRY * (len(self.block_hashes) + 1) + 12 * self.block_size


@dataclass(frozen=True)
class FetchResult:
    files: int  # files written into this store
    bytes: int
    seconds: float
    local: bool  # the hand-over was on this replica's disk (a shared store): nothing crossed the network
    fallback: str | None = None  # why the fetch did not complete (FALLBACK_REASONS), or None
    detail: str = ""


class FetchFailed(Exception):
    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(detail)
        self.reason = reason


class FetchJob(Future):
    """A fetch queued or running on a FetchPool, which its request can abandon (an abort): one not yet
    started never starts, and a running one's socket is shut, so its thread is free again at once."""

    def __init__(self) -> None:
        super().__init__()
        self._abandoned = False
        self._remote: _Remote | None = None
        self._guard = threading.Lock()

    def abandon(self) -> None:
        with self._guard:
            self._abandoned, remote = True, self._remote
        self.cancel()
        if remote is not None:
            remote.abort()

    def attach(self, remote: _Remote) -> bool:
        """The fetch's connection, so an abandon can shut it; False if the job is abandoned already."""
        with self._guard:
            self._remote = remote
            return not self._abandoned


class FetchPool:
    """At most `size` fetches at once, on daemon threads (one blocked on a peer can hold up neither
    another pool's work nor the process's exit); the rest wait their turn in order."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._jobs: queue.SimpleQueue[tuple[FetchJob, Callable[[FetchJob], Any]]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[FetchJob], Any]) -> FetchJob:
        """Run `fn(job)` on a pool thread; the job is the Future of its result."""
        job = FetchJob()
        self._jobs.put((job, fn))
        with self._lock:
            if len(self._threads) < self.size:
                thread = threading.Thread(target=self._work, name="v4serve-kv-fetch", daemon=True)
                self._threads.append(thread)
                thread.start()
        return job

    def _work(self) -> None:
        while True:
            job, fn = self._jobs.get()
            if job.set_running_or_notify_cancel():
                try:
                    job.set_result(fn(job))
                except BaseException as exc:  # handed to whoever waits
                    job.set_exception(exc)


def fetch(store: SSDStore, source: KVSource, expected: ExpectedPrefix, config: KVTransferConfig,
          deadline: float, job: FetchJob | None = None) -> FetchResult:
    """Bring a hand-over's files this store lacks into it, each checked against `expected` (a fetch
    thread's work; never raises). `deadline`: time.monotonic() by which it ends, whatever the peer does;
    `job`: the pool's handle, through which the request can abandon it."""
    t0 = time.perf_counter()
    progress = [0, 0]  # files, bytes written so far
    local = store.handover_dir(source.transfer_id)
    try:
        if not config.lists(source.host, source.port):
            raise FetchFailed("unlisted", f"{source.host}:{source.port} is not one of this replica's producers: "
                                          "nothing is fetched from it")
        if time.monotonic() >= deadline:
            raise FetchFailed("timeout", "the fetch's deadline passed while it waited for a fetch thread")
        if (local / MANIFEST).is_file():
            complete = _fetch_local(store, local, expected, progress)
            return FetchResult(*progress, time.perf_counter() - t0, True, None if complete else "incomplete")
        remote = _Remote(store, source, expected, config.secret, deadline)
        if job is not None and not job.attach(remote):
            raise FetchFailed("timeout", "the request was abandoned before its fetch began")
        complete = remote.fetch(progress)
        return FetchResult(*progress, time.perf_counter() - t0, False, None if complete else "incomplete")
    except FetchFailed as exc:
        return FetchResult(*progress, time.perf_counter() - t0, local.exists(), exc.reason, str(exc))
    except Exception as exc:  # a fault of this code: the request computes its prompt, the engine goes on
        log.exception("fetching hand-over %s failed", source.transfer_id)
        return FetchResult(*progress, time.perf_counter() - t0, False, "corrupt", f"{type(exc).__name__}: {exc}")


def verify_manifest(store: SSDStore, manifest: Any, expected: ExpectedPrefix) -> tuple[list[tuple[Entry, int]], bool]:
    """(the entries this store lacks, each with its exact file size; whether the hand-over is whole): the
    manifest must list the files `expected` implies, in order (a shorter list is a partial hand-over)."""
    try:
        listed, complete = manifest["files"], manifest.get("complete", True)
        if not isinstance(listed, list) or not isinstance(complete, bool):
            raise TypeError("files must be a list and complete a boolean")
        want = expected.entries()
        if len(listed) > len(want):
            raise FetchFailed("unverified", f"a manifest of {len(listed)} files where this prompt's hand-over has "
                                            f"at most {len(want)}")
        wanted = []
        for given, entry in zip(listed, want, strict=False):  # a shorter list: a partial hand-over
            if (not isinstance(given, dict) or type(given.get("kind")) is not int or given["kind"] != entry.kind
                    or given.get("key") != entry.key.hex() or given.get("name") != entry.name):
                raise FetchFailed("unverified", f"the manifest's file {len(wanted)} is not this prompt's "
                                                f"{entry.name} (another prompt, tenant or model)")
            size = store.file_size(entry.kind, len(entry.tokens) // 4)
            if given.get("size") != size:
                raise FetchFailed("corrupt", f"{entry.name}: a size of {given.get('size')!r} where such a file has "
                                             f"{size} bytes")
            if not _present(store, entry):
                wanted.append((entry, size))
        return wanted, complete and len(listed) == len(want)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise FetchFailed("corrupt", f"a manifest that does not parse: {exc}") from exc


def _present(store: SSDStore, entry: Entry) -> bool:
    if entry.kind == KIND_RESPONSE:
        assert entry.parent is not None
        return entry.key in store.responses(entry.parent)
    return store.has(entry.kind, entry.key)


def _import(store: SSDStore, entry: Entry, data: bytes | bytearray | memoryview, progress: list[int]) -> None:
    try:
        written = store.import_file(entry.kind, entry.key, data, entry.parent, entry.tokens)
    except StoreFileError as exc:
        reason = "unverified" if exc.kind == "collision" else "corrupt"
        raise FetchFailed(reason, f"{entry.name}: {exc}") from exc
    except OSError as exc:
        raise FetchFailed("store", f"{entry.name} could not be written: {exc}") from exc
    progress[0] += 1 if written else 0
    progress[1] += written


def _parse_manifest(data: bytes) -> Any:
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise FetchFailed("corrupt", f"a manifest that is not JSON: {str(exc)[:200]}") from exc


def _fetch_local(store: SSDStore, folder: Path, expected: ExpectedPrefix, progress: list[int]) -> bool:
    try:
        fd, _ = open_store_file(folder / MANIFEST)  # never through a link, never a FIFO's endless wait
        with open(fd, "rb") as file:
            data = file.read(expected.manifest_limit() + 1)
        if len(data) > expected.manifest_limit():
            raise FetchFailed("unverified", f"a manifest of over {expected.manifest_limit()} bytes where this "
                                            "prompt's hand-over needs less")
        wanted, complete = verify_manifest(store, _parse_manifest(data), expected)
        for entry, _ in wanted:
            try:
                data = read_store_file(folder / entry.name, entry.kind, store.layout, store.payload_bytes[entry.kind])
            except StoreFileError as exc:
                raise FetchFailed("corrupt", f"{entry.name}: {exc}") from exc
            _import(store, entry, data, progress)
    except StoreFileError as exc:
        raise FetchFailed("corrupt", f"the shared hand-over's manifest: {exc}") from exc
    except OSError as exc:
        raise FetchFailed("incomplete", f"the shared hand-over folder went away: {exc}") from exc
    shutil.rmtree(folder, ignore_errors=True)  # fetched: the prefill replica need not hold it longer
    return complete


class _Remote:
    """One fetch over TCP from a listed producer: every request proven, every answer checked, the
    whole of it ended at `deadline` by shutting the socket (a peer that drips a byte at a time, or
    stops answering mid-reply, cannot hold it longer), or at once when its request is abandoned."""

    def __init__(self, store: SSDStore, source: KVSource, expected: ExpectedPrefix, secret: bytes,
                 deadline: float) -> None:
        self.store, self.source, self.expected, self.secret, self.deadline = store, source, expected, secret, deadline
        self.conn: http.client.HTTPConnection | None = None
        self.cut = threading.Event()  # set once the deadline (or an abandon) has shut the socket
        self.timer: threading.Timer | None = None
        self.verified = False  # the manifest was this request's own: releasing the hand-over is ours to do

    def fetch(self, progress: list[int]) -> bool:
        try:
            return self._exchange(progress)
        except FetchFailed:
            raise
        except (OSError, http.client.HTTPException, ValueError) as exc:
            if self.cut.is_set() or time.monotonic() >= self.deadline:
                raise FetchFailed("timeout", f"the fetch passed its deadline ({exc})") from exc
            raise FetchFailed("unreachable", f"{self.source.host}:{self.source.port}: {exc}") from exc
        finally:
            self._finish()

    def abort(self) -> None:
        """The request went (from another thread): its socket is shut now."""
        self.deadline = time.monotonic()
        conn = self.conn
        if conn is not None and conn.sock is not None:
            self._cut(conn.sock)

    def _left(self) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0 or self.cut.is_set():
            raise FetchFailed("timeout", "the fetch passed its deadline")
        return left

    def _connect(self) -> None:
        """A connection, every address tried within what is left of the deadline, and the deadline's cut
        armed on it."""
        if self.timer is not None:
            self.timer.cancel()
        if self.conn is not None:
            self.conn.close()
        sock, last = None, OSError(f"{self.source.host} has no address")
        for family, kind, proto, _, address in socket.getaddrinfo(self.source.host, self.source.port,
                                                                   type=socket.SOCK_STREAM):
            candidate = socket.socket(family, kind, proto)
            try:
                candidate.settimeout(self._left())
                candidate.connect(address)
            except OSError as exc:
                candidate.close()
                last = exc
                continue
            except FetchFailed:
                candidate.close()
                raise
            sock = candidate
            break
        if sock is None:
            raise last
        self.conn = http.client.HTTPConnection(self.source.host, self.source.port)
        self.conn.sock = sock
        self.conn.auto_open = 0  # never a socket of its own making, which the deadline would not shut
        self.timer = threading.Timer(self._left(), self._cut, args=(sock,))
        self.timer.daemon = True
        self.timer.start()

    def _sock(self) -> socket.socket:
        """The connection's socket (a new one if the producer closed the last), its timeout what is left
        of the deadline."""
        if self.conn is None or self.conn.sock is None:
            self._connect()
        assert self.conn is not None and self.conn.sock is not None
        self.conn.sock.settimeout(self._left())
        return self.conn.sock

    def _cut(self, sock: socket.socket) -> None:
        self.cut.set()
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)  # every blocked or later read on it ends at once

    def _request(self, method: str, target: str, body: bytes = b"") -> tuple[http.client.HTTPResponse, str]:
        proof, nonce = request_proof(self.secret, method, target, body)
        headers = {PEER_HEADER: proof}
        if body:
            headers["Content-Type"] = "application/json"
        self._sock()
        assert self.conn is not None
        self.conn.request(method, target, body=body or None, headers=headers)
        reply = self.conn.getresponse()
        if reply.status != 200:
            text = reply.read(2000).decode("utf-8", "replace")
            reason = "unauthenticated" if reply.status in (401, 403) else "refused"
            raise FetchFailed(reason, f"{method} {target} answered {reply.status}: {text}")
        return reply, nonce

    def _exchange(self, progress: list[int]) -> bool:
        source, limit = self.source, self.expected.manifest_limit()
        wait = f"?wait={0.8 * self._left():.3f}" if source.wait else ""
        reply, nonce = self._request("GET", PATH + source.transfer_id + wait)
        body = reply.read(limit + 1)
        if len(body) > limit:
            raise FetchFailed("unverified", f"a manifest of over {limit} bytes, more than this prompt's needs")
        try:
            check_reply(self.secret, nonce, body, reply.getheader(REPLY_HEADER))
        except PeerRefused as exc:
            raise FetchFailed("unauthenticated", str(exc)) from exc
        wanted, complete = verify_manifest(self.store, _parse_manifest(body), self.expected)
        self.verified = True
        if wanted:
            self._files(wanted, progress)
        return complete

    def _files(self, wanted: list[tuple[Entry, int]], progress: list[int]) -> None:
        reply, nonce = self._request("POST", PATH + self.source.transfer_id + "/files",
                                     json.dumps({"names": [e.name for e, _ in wanted]}).encode())
        for index, (entry, size) in enumerate(wanted):
            self._sock()
            data = reply.read(size + MAC_BYTES)
            if len(data) != size + MAC_BYTES:
                raise FetchFailed("incomplete", f"the reply ended inside {entry.name}")
            mac = file_mac(self.secret, nonce, index, entry.name)
            mac.update(memoryview(data)[:size])
            if not hmac.compare_digest(mac.digest(), data[size:]):
                raise FetchFailed("unauthenticated", f"{entry.name} is not proven with the peer secret")
            _import(self.store, entry, memoryview(data)[:size], progress)
        if reply.read(1):
            raise FetchFailed("corrupt", "the files' reply goes on past the files asked for")

    def _finish(self) -> None:
        """The request goes on at once; the hand-over is released (only one that was this request's own,
        and best effort: the producer's sweep drops it otherwise) on a thread of its own."""
        if self.verified and not self.cut.is_set() and self.conn is not None:
            threading.Thread(target=self._release, name="v4serve-kv-release", daemon=True).start()
        else:
            self._close()

    def _release(self) -> None:
        try:
            self.deadline = min(self.deadline, time.monotonic() + RELEASE_SECONDS)
            self._request("DELETE", PATH + self.source.transfer_id)[0].read(4096)
        except Exception:  # noqa: BLE001 - a release is a courtesy: the sweep does it otherwise
            pass
        finally:
            self._close()

    def _close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
        if self.conn is not None:
            self.conn.close()
