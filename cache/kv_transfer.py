"""Prefill and decode on separate replicas: a prompt's KV handed from the replica that computed it to
the one that decodes it. Plain Python, no torch.

What is handed over is what a prefix hit reads: the prompt's sealed blocks and the slot's state just
before its last token (a sealed snapshot at a block boundary, else a response end with its open
block), as SSD-store files. The prefill replica links them into `handover/<id>/` of its store with a
manifest (`SSDStore.hand_over`); the decode replica gets the files it lacks and writes them into its
own store, where its ordinary disk-hit path finds them. How the files travel:

- **Shared store** (both replicas mount the same `--kv-store-dir`): the manifest is on the decode
  replica's own disk. A file the two stores share by name is not copied at all; one under another
  name (another namespace folder) is read from the hand-over folder.
- **Otherwise, over TCP**: the decode replica asks the prefill replica's HTTP server for the manifest
  (`GET /v4serve/kv_transfer/{id}`) and then for the files it lacks, streamed back to back in one
  reply (`POST /v4serve/kv_transfer/{id}/files`), with the daemon's API key.

Every file is checked as a store read checks it (checksum, namespace, layout, key) before it is
written: a transfer can make a hit shorter, never wrong. A transfer that fails leaves what arrived
intact and the decode replica computes the rest (a fallback, counted by reason).
"""

from __future__ import annotations

import hashlib
import hmac
import http.client
import json
import re
import shutil
import time
import uuid
from dataclasses import dataclass, fields
from typing import Any

from v4serve.cache.ssd_file import KIND_BLOCK, KIND_RESPONSE, KIND_SNAPSHOT, StoreFileError
from v4serve.cache.ssd_store import MANIFEST, SSDStore

ROLES = ("kv_producer", "kv_consumer", "kv_both")
CONNECTOR = "V4ServeConnector"
# vLLM's keys that mean nothing for a hand-over over HTTP or a shared store: accepted, not used.
VLLM_IGNORED = ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_connector_module_path",
                "enable_permute_local_kv")
TRANSFER_ID = re.compile(r"[0-9a-f]{32}")
KINDS = (KIND_BLOCK, KIND_SNAPSHOT, KIND_RESPONSE)
PATH = "/v4serve/kv_transfer/"  # + id (the manifest), + id + "/files" (the files asked for)
FALLBACK_REASONS = ("unreachable", "timeout", "refused", "corrupt", "incomplete", "store", "unsigned")


@dataclass(frozen=True)
class KVTransferConfig:
    """`--kv-transfer-config`, vLLM's JSON shape: `{"kv_connector": "V4ServeConnector", "kv_role":
    "kv_producer" | "kv_consumer" | "kv_both", "kv_ip", "kv_port", "engine_id",
    "kv_connector_extra_config": {"hold_seconds", "fetch_timeout", "peer_api_key"}}`."""

    kv_role: str
    kv_connector: str = CONNECTOR
    engine_id: str = ""
    kv_ip: str | None = None  # where decode replicas reach this one (default: its --host, if not a wildcard)
    kv_port: int | None = None  # default: its --port
    kv_load_failure_policy: str = "recompute"  # vLLM's: a failed load is computed instead
    hold_seconds: float = 120.0  # a hand-over nobody fetched is dropped after this
    fetch_timeout: float = 30.0  # a fetch still running after this is abandoned (what arrived is kept)
    peer_api_key: str | None = None  # the key sent to prefill replicas (default: this daemon's --api-key)
    # "host:port" of prefill replicas whose hand-overs are fetched unsigned though this daemon has a key
    # (SGLang's router sends both legs at once: there is no prefill reply to carry a signature).
    trusted_producers: tuple[str, ...] = ()

    @property
    def producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, text: str) -> KVTransferConfig:
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
        own = {"hold_seconds", "fetch_timeout", "peer_api_key", "trusted_producers"}
        known = {f.name for f in fields(cls)} - own
        unknown = sorted(set(raw) - known) + [f"kv_connector_extra_config.{k}" for k in sorted(set(extra) - own)]
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown keys {unknown}; known: {sorted(known | {*VLLM_IGNORED})} "
                             f"and kv_connector_extra_config's {sorted(own)}")
        if raw.get("kv_connector") is None:
            raw.pop("kv_connector", None)
        trusted = extra.pop("trusted_producers", [])
        if not isinstance(trusted, list) or not all(isinstance(t, str) and ":" in t for t in trusted):
            raise ValueError('--kv-transfer-config: trusted_producers must be a list of "host:port"')
        config = cls(**raw, **extra, trusted_producers=tuple(trusted))
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
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"--kv-transfer-config: {name} must be a positive number of seconds")
        if self.kv_port is not None and (isinstance(self.kv_port, bool) or not isinstance(self.kv_port, int)
                                         or not 0 < self.kv_port < 65536):
            raise ValueError("--kv-transfer-config: kv_port must be a port number")
        for name in ("engine_id", "kv_ip", "peer_api_key"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"--kv-transfer-config: {name} must be a string")


def new_transfer_id() -> str:
    return uuid.uuid4().hex


def signature(secret: str | None, transfer_id: str, host: str, port: int) -> str | None:
    """What a prefill replica signs its hand-over's address with (the daemons' shared API key), so a
    decode replica never sends its key to a host a client named."""
    if not secret:
        return None
    message = f"{transfer_id}|{host}|{port}".encode()
    return hmac.new(secret.encode(), message, hashlib.sha256).hexdigest()


@dataclass(frozen=True)
class KVSource:
    """Where a decode replica gets a request's KV: a prefill replica's hand-over."""

    host: str
    port: int
    transfer_id: str
    signature: str | None = None  # `signature(key, ...)` by the prefill replica, when it has a key
    # The hand-over may still be being made (SGLang's router sends both legs at once): the prefill replica
    # is asked to wait for it. vLLM's sends the decode leg once the prefill leg has answered.
    wait: bool = False


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


def fetch(store: SSDStore, source: KVSource, timeout: float, api_key: str | None,
          trusted: tuple[str, ...] = ()) -> FetchResult:
    """Bring a hand-over's files this store lacks into it (a reader thread's work; never raises). With
    an API key, only from addresses signed with it or listed in `trusted`."""
    t0 = time.perf_counter()
    progress = [0, 0]  # files, bytes written so far
    local = store.handover_dir(source.transfer_id)
    try:
        expected = signature(api_key, source.transfer_id, source.host, source.port)
        if (expected is not None and not hmac.compare_digest(expected, source.signature or "")
                and f"{source.host}:{source.port}" not in trusted):
            raise FetchFailed("unsigned", f"a hand-over from {source.host}:{source.port} not signed with this "
                                          "daemon's key: its key is not sent there")
        if (local / MANIFEST).is_file():
            complete = _fetch_local(store, source, progress)
            return FetchResult(*progress, time.perf_counter() - t0, True, None if complete else "incomplete")
        complete = _fetch_remote(store, source, timeout, api_key, progress)
        return FetchResult(*progress, time.perf_counter() - t0, False, None if complete else "incomplete")
    except FetchFailed as exc:
        return FetchResult(*progress, time.perf_counter() - t0, local.exists(), exc.reason, str(exc))


def _missing(store: SSDStore, manifest: dict[str, Any]) -> tuple[list[dict[str, Any]], bool]:
    """(the manifest's entries this store lacks, in order; whether the hand-over is whole)."""
    try:
        entries = manifest["files"]
        previous = None
        for e in entries:  # blocks come in chain order: each continues the one before (KV events name it)
            if int(e["kind"]) == KIND_BLOCK:
                e["parent"], previous = previous, e["key"]
        wanted = [e for e in entries if not _present(store, e)]
        return wanted, bool(manifest.get("complete", True))
    except (KeyError, TypeError, ValueError) as exc:
        raise FetchFailed("corrupt", f"a manifest that does not parse: {exc}") from exc


def _present(store: SSDStore, entry: dict[str, Any]) -> bool:
    kind, key = int(entry["kind"]), bytes.fromhex(entry["key"])
    if kind not in KINDS or not isinstance(entry["name"], str) or not isinstance(entry["size"], int):
        raise ValueError(f"an entry {entry!r}")
    if kind == KIND_RESPONSE:
        return key in store.responses(bytes.fromhex(entry["parent"]))
    return store.has(kind, key)


def _import(store: SSDStore, entry: dict[str, Any], data: bytes | bytearray, progress: list[int]) -> None:
    parent = bytes.fromhex(entry["parent"]) if entry.get("parent") else None
    try:
        written = store.import_file(int(entry["kind"]), bytes.fromhex(entry["key"]), data, parent)
    except StoreFileError as exc:
        raise FetchFailed("corrupt", f"{entry['name']}: {exc}") from exc
    except OSError as exc:
        raise FetchFailed("store", f"{entry['name']} could not be written: {exc}") from exc
    progress[0] += 1 if written else 0
    progress[1] += written


def _fetch_local(store: SSDStore, source: KVSource, progress: list[int]) -> bool:
    folder = store.handover_dir(source.transfer_id)
    try:
        manifest = json.loads((folder / MANIFEST).read_text())
        wanted, complete = _missing(store, manifest)
        for entry in wanted:
            _import(store, entry, (folder / _plain_name(entry)).read_bytes(), progress)
    except OSError as exc:
        raise FetchFailed("incomplete", f"the shared hand-over folder went away: {exc}") from exc
    shutil.rmtree(folder, ignore_errors=True)  # fetched: the prefill replica need not hold it longer
    return complete


def _plain_name(entry: dict[str, Any]) -> str:
    name = entry["name"]
    if not re.fullmatch(r"[0-9a-f]{64}\.(blk|snap|resp)", name):
        raise FetchFailed("corrupt", f"a manifest naming {name[:80]!r}")
    return name


def _fetch_remote(store: SSDStore, source: KVSource, timeout: float, api_key: str | None,
                  progress: list[int]) -> bool:
    deadline = time.monotonic() + timeout
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    conn = http.client.HTTPConnection(source.host, source.port, timeout=timeout)
    try:
        wait = f"?wait={0.8 * timeout:g}" if source.wait else ""
        manifest = json.loads(_request(conn, "GET", PATH + source.transfer_id + wait, headers, None).read())
        wanted, complete = _missing(store, manifest)
        if not wanted:
            return complete
        body = json.dumps({"names": [_plain_name(e) for e in wanted]}).encode()
        reply = _request(conn, "POST", PATH + source.transfer_id + "/files",
                         {**headers, "Content-Type": "application/json"}, body)
        for entry in wanted:
            if time.monotonic() > deadline:
                raise FetchFailed("timeout", f"the fetch took over {timeout:g} s")
            data = reply.read(entry["size"])
            if len(data) != entry["size"]:
                raise FetchFailed("incomplete", f"the reply ended inside {entry['name']}")
            _import(store, entry, data, progress)
        return complete
    except TimeoutError as exc:
        raise FetchFailed("timeout", f"no answer within {timeout:g} s") from exc
    except (OSError, http.client.HTTPException) as exc:
        raise FetchFailed("unreachable", f"{source.host}:{source.port}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise FetchFailed("corrupt", f"a manifest that is not JSON: {exc}") from exc
    finally:
        conn.close()


def _request(conn: http.client.HTTPConnection, method: str, path: str, headers: dict[str, str],
             body: bytes | None) -> http.client.HTTPResponse:
    conn.request(method, path, body=body, headers=headers)
    reply = conn.getresponse()
    if reply.status != 200:
        text = reply.read(2000).decode("utf-8", "replace")
        raise FetchFailed("refused", f"{method} {path} answered {reply.status}: {text}")
    return reply
