"""The HTTP side of prefill and decode on separate replicas (`cache/kv_transfer.py` has the rest): what
a request's `kv_transfer_params` ask of this replica, the `kv_transfer_params` a prefill replica's reply
carries, and the endpoints decode replicas fetch hand-overs from.

The protocol is vLLM's, as its router drives it: the prefill leg carries `{"do_remote_decode": true}`
and `max_tokens: 1`; its reply's `kv_transfer_params` say where the KV is (`remote_host`,
`remote_port`, `remote_request_id`); the decode leg is the original request with those params
(`do_remote_prefill: true`). A decode leg may name only a producer this replica lists (a 400 otherwise:
a client cannot make it fetch from, or talk to, an address of its choosing).

The endpoints (`PATH`) answer only the fleet's replicas: each request must carry a proof made with the
peer secret (`cache/peer_auth.py`), in place of an API key. Their reads are bounded (the files request's
body, each name once, files opened one at a time as they are sent and closed when the reader goes), and
only the consumer that fetched a hand-over (`DELETE`) or the store's sweep removes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from v4serve.cache.kv_transfer import PATH, TRANSFER_ID, KVSource, KVTransferConfig, new_transfer_id
from v4serve.cache.peer_auth import (
    PEER_HEADER,
    REPLY_HEADER,
    NonceWindow,
    PeerRefused,
    Proven,
    check_request,
    file_mac,
    reply_proof,
)
from v4serve.cache.ssd_store import HANDOVER_DIR, MANIFEST
from v4serve.server.errors import ApiError
from v4serve.server.protocol import note_once

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20  # bytes of a hand-over file read at a time while it is sent
MANIFEST_POLL = 0.005  # seconds between looks for a hand-over's manifest
MAX_MANIFEST_BYTES = 64 << 20  # no manifest a producer wrote is larger (a million-token prompt's is ~4 MB)
FILES_BODY_BYTES = 4 << 20  # a files request's body: the names of 58,000 files (a 7M-token prompt's)
UNKNOWN_GRACE = 5.0  # seconds a manifest request waits for a prefill leg this replica has not yet seen


@dataclass(frozen=True)
class Handovers:
    """This replica's role in hand-overs, and where its own are."""

    config: KVTransferConfig
    store_root: Path
    host: str  # where decode replicas reach this one
    port: int
    pending: PendingHandovers = field(default_factory=lambda: PendingHandovers(None), compare=False, repr=False)
    seen: NonceWindow = field(default_factory=NonceWindow, compare=False, repr=False)

    @property
    def engine_id(self) -> str:
        return self.config.engine_id or f"v4serve@{self.host}:{self.port}"

    def folder(self, transfer_id: str) -> Path:
        if not TRANSFER_ID.fullmatch(transfer_id):
            raise ApiError(404, "no such hand-over", code="not_found")
        return self.store_root / HANDOVER_DIR / transfer_id

    async def reply_params(self, transfer_id: str | None) -> dict[str, Any] | None:
        """A prefill replica's reply: where its hand-over is, once its manifest is on disk (the store's
        writer links it after the prompt's files are written); None if it never appears (the decode
        replica then computes the prompt)."""
        if transfer_id is None:
            return None
        manifest = self.folder(transfer_id) / MANIFEST
        deadline = time.monotonic() + self.config.fetch_timeout
        while not manifest.is_file():
            if time.monotonic() > deadline:
                log.warning("hand-over %s was not written within %.0f s: the decode replica will compute the prompt",
                            transfer_id, self.config.fetch_timeout)
                return None
            await asyncio.sleep(MANIFEST_POLL)
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_block_ids": None, "remote_host": self.host, "remote_port": self.port,
                "remote_request_id": transfer_id}

    # ---- the endpoints decode replicas fetch from ------------------------------------------------------
    def producing(self) -> None:
        """A role mismatch is answered at once (a consumer-only replica holds no hand-overs)."""
        if not self.config.producer:
            raise ApiError(404, "this replica hands no KV over (--kv-transfer-config kv_role)", code="not_found")

    def authenticate(self, raw: Request) -> Proven:
        """The request as proven with the peer secret (its nonce, its body's digest), before any of its body
        is read; a 401 otherwise."""
        target = raw.scope.get("raw_path", raw.url.path.encode()).decode("latin-1")
        if raw.scope.get("query_string"):
            target += "?" + raw.scope["query_string"].decode("latin-1")
        try:
            return check_request(self.config.secret, raw.method, target, raw.headers.get(PEER_HEADER), self.seen)
        except PeerRefused as exc:
            raise refused(raw, exc) from exc

    async def proven_body(self, raw: Request, proven: Proven) -> bytes:
        """A proven request's body (at most FILES_BODY_BYTES), checked against its proof."""
        body = await bounded_body(raw, FILES_BODY_BYTES)
        try:
            proven.check_body(body)
        except PeerRefused as exc:
            raise refused(raw, exc) from exc
        return body

    def _manifest_bytes(self, transfer_id: str) -> bytes:
        try:
            with open(self.folder(transfer_id) / MANIFEST, "rb") as file:
                data = file.read(MAX_MANIFEST_BYTES + 1)
        except OSError as exc:
            raise ApiError(404, f"no hand-over {transfer_id} here (released already, or older than "
                                f"{self.config.hold_seconds:g} s)", code="not_found") from exc
        if len(data) > MAX_MANIFEST_BYTES:
            raise ApiError(404, f"hand-over {transfer_id}'s manifest is not one this replica wrote", code="not_found")
        return data

    async def manifest_when_made(self, transfer_id: str, wait: float, nonce: str) -> Response:
        """The manifest, proven for this request, waiting up to `wait` seconds for it to be made (SGLang's
        router sends the decode leg as the prefill leg starts; vLLM's only once it has ended, when it is
        there already). A hand-over this replica has no prefill leg for is not waited for past
        `UNKNOWN_GRACE` (a decode leg naming a room nobody prefills would hold its fetch for the whole wait)."""
        folder = self.folder(transfer_id)
        start = time.monotonic()
        deadline = start + min(max(wait, 0.0), self.config.fetch_timeout)
        while not (folder / MANIFEST).is_file() and time.monotonic() < deadline:
            if time.monotonic() - start > UNKNOWN_GRACE and not self.pending.known(transfer_id):
                break
            await asyncio.sleep(MANIFEST_POLL * 4)
        body = await asyncio.to_thread(self._manifest_bytes, transfer_id)
        self.pending.discard(transfer_id)
        return Response(body, media_type="application/json",
                        headers={REPLY_HEADER: reply_proof(self.config.secret, nonce, body)})

    def file_names(self, transfer_id: str, body: bytes) -> list[str]:
        """The files a request asks for: each a file of the manifest, each once, at least one."""
        try:
            names = json.loads(body)["names"]
        except (ValueError, KeyError, TypeError, RecursionError) as exc:
            raise ApiError(400, 'the body must be {"names": [...]}', param="names") from exc
        listed = {e.get("name") for e in json.loads(self._manifest_bytes(transfer_id))["files"]}
        if not isinstance(names, list) or not names or not all(isinstance(n, str) and n in listed for n in names):
            raise ApiError(400, "names must list one or more files of the hand-over's manifest", param="names")
        if len(set(names)) != len(names):
            raise ApiError(400, "names must list each file once", param="names")
        return names

    def files(self, transfer_id: str, names: list[str], nonce: str, sent: Any, sent_bytes: Any) -> StreamingResponse:
        """The named files back to back, each followed by its MAC; `sent`/`sent_bytes`: metric series."""
        return ClosingStream(self._send(self.folder(transfer_id), names, nonce, sent, sent_bytes),
                             media_type="application/octet-stream")

    async def _send(self, folder: Path, names: list[str], nonce: str, sent: Any, sent_bytes: Any
                    ) -> AsyncIterator[bytes]:
        for index, name in enumerate(names):
            mac = file_mac(self.config.secret, nonce, index, name)
            try:
                file = await asyncio.to_thread(open, folder / name, "rb")
            except OSError as exc:  # released or swept meanwhile: the reply ends short, the reader falls back
                log.warning("hand-over %s: %s went while it was sent (%s)", folder.name, name, exc)
                return
            try:
                while chunk := await asyncio.to_thread(_read_into_mac, file, mac):
                    sent_bytes.inc(len(chunk))
                    yield chunk
            finally:
                file.close()
            yield mac.digest()
        sent.inc()

    def release(self, transfer_id: str) -> None:
        """The consumer has what it needed: the hand-over is held no longer."""
        shutil.rmtree(self.folder(transfer_id), ignore_errors=True)


class PendingHandovers:
    """The transfer ids this producer has taken a prefill leg for, so a manifest request for one it has
    never heard of is answered at once. Kept in memory and, with several API-server processes (a prefill
    leg and the decode replica's request may reach different ones), as empty files in their shared
    folder; an entry older than `hold` seconds is forgotten."""

    def __init__(self, folder: Path | None, hold: float = 120.0) -> None:
        self.folder, self.hold = folder, hold
        self._ids: dict[str, float] = {}
        if folder is not None:
            folder.mkdir(mode=0o700, exist_ok=True)

    def add(self, transfer_id: str) -> None:
        now = time.monotonic()
        self._ids[transfer_id] = now
        if len(self._ids) > 4096:  # forget the stale (a prefill leg that failed before its hand-over)
            self._ids = {t: at for t, at in self._ids.items() if now - at < self.hold}
        if self.folder is not None:
            with contextlib.suppress(OSError):
                (self.folder / transfer_id).touch()

    def known(self, transfer_id: str) -> bool:
        at = self._ids.get(transfer_id)
        if at is not None and time.monotonic() - at < self.hold:
            return True
        if self.folder is None:
            return False
        try:
            return time.time() - (self.folder / transfer_id).stat().st_mtime < self.hold
        except OSError:
            return False

    def discard(self, transfer_id: str) -> None:
        self._ids.pop(transfer_id, None)
        if self.folder is not None:
            with contextlib.suppress(OSError):
                (self.folder / transfer_id).unlink()


def refused(raw: Request, exc: PeerRefused) -> ApiError:
    log.warning("a hand-over request from %s refused: %s", raw.client.host if raw.client else "?", exc)
    return ApiError(401, str(exc), code="peer_unauthenticated")


def _read_into_mac(file: IO[bytes], mac: Any) -> bytes:
    chunk = file.read(READ_CHUNK)
    mac.update(chunk)  # off the event loop, beside the read (hashlib releases the GIL for large chunks)
    return chunk


class ClosingStream(StreamingResponse):
    """A stream whose source is closed however the response ends, the reader's leaving included: the file
    it has open is closed then, not whenever the garbage collector gets to it."""

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()  # type: ignore[attr-defined]


async def bounded_body(raw: Request, limit: int) -> bytes:
    """The request's body, a 400 once it passes `limit` bytes (nothing more is kept)."""
    parts, size = [], 0
    async for part in raw.stream():
        size += len(part)
        if size > limit:
            raise ApiError(400, f"the body is over {limit} bytes", param="names")
        parts.append(part)
    return b"".join(parts)


def _listed(handovers: Handovers, host: str, port: int) -> None:
    if not handovers.config.lists(host, port):
        note_once(f"pd-unlisted-{host}:{port}", "a decode leg names %s:%d, which is not among this replica's "
                  "producers (kv_connector_extra_config.producers): refused with a 400", host, port,
                  level=logging.WARNING)
        raise ApiError(400, f"kv_transfer_params name {host}:{port}, which is not a prefill replica this replica "
                            "fetches from", param="kv_transfer_params")


def sglang_transfer(handovers: Handovers | None, host: str | None, port: int | None,
                    room: int | None) -> tuple[str | None, KVSource | None]:
    """SGLang's router sends the same request to the prefill and the decode replica at once, naming the
    prefill replica (`bootstrap_host`, `bootstrap_port`: give it the prefill replica's own HTTP port) and a
    room: the prefill replica hands over under the room's id, the decode replica fetches it from there
    (the prefill replica's manifest request waits until the hand-over is made)."""
    if room is None:
        return None, None
    if handovers is None or host is None or port is None:
        note_once("sglang-pd-role", "a request names an SGLang bootstrap room, but this replica has no "
                  "--kv-transfer-config role (or the request names no bootstrap host and port): it is served "
                  "whole here", level=logging.WARNING)
        return None, None
    transfer_id = f"{room:032x}"
    here = host == handovers.host and port == handovers.port
    if handovers.config.producer and (here or not handovers.config.consumer):
        handovers.pending.add(transfer_id)
        return transfer_id, None
    if handovers.config.consumer:
        _listed(handovers, host, port)
        return None, KVSource(host, port, transfer_id, wait=True)
    return None, None


def request_transfer(handovers: Handovers | None, params: dict[str, Any] | None, stream: bool,
                     prompts: int) -> tuple[str | None, KVSource | None]:
    """(the transfer id to hand this request's KV over under, the prefill replica to fetch it from) as
    its `kv_transfer_params` ask and this replica's role allows; a request a replica cannot serve that
    way is computed as any other (logged once), a decode leg naming an unlisted producer is a 400."""
    if not params:
        return None, None
    if params.get("do_remote_decode"):
        if handovers is None or not handovers.config.producer:
            note_once("pd-not-producer", "a request asks for its KV to be handed over, but this replica is no prefill "
                      "replica (--kv-transfer-config kv_role kv_producer or kv_both): it is served whole here",
                      level=logging.WARNING)
        elif stream or prompts != 1:
            note_once("pd-stream", "a hand-over is made for one prompt, not streamed (as vLLM's router sends the "
                      "prefill leg); this request is served without one", level=logging.WARNING)
        else:
            transfer_id = new_transfer_id()
            handovers.pending.add(transfer_id)
            return transfer_id, None
        return None, None
    if params.get("do_remote_prefill"):
        if handovers is None or not handovers.config.consumer:
            note_once("pd-not-consumer", "a request names a hand-over to fetch, but this replica is no decode replica "
                      "(--kv-transfer-config kv_role kv_consumer or kv_both): it computes the prompt",
                      level=logging.WARNING)
            return None, None
        found = source(params)
        if found is not None:
            _listed(handovers, found.host, found.port)
        return None, found
    return None, None


def source(params: dict[str, Any]) -> KVSource | None:
    """The prefill replica a decode leg's params name (None: it names none; the prompt is computed)."""
    host, port, transfer_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    if host is None and transfer_id is None:
        return None
    if (not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int)
            or not 0 < port < 65536 or not isinstance(transfer_id, str) or not TRANSFER_ID.fullmatch(transfer_id)):
        raise ApiError(400, "kv_transfer_params must name remote_host, remote_port and a remote_request_id from a "
                            "v4serve prefill replica's reply", param="kv_transfer_params")
    return KVSource(host, port, transfer_id)


__all__ = ["PATH", "Handovers", "PendingHandovers", "request_transfer", "sglang_transfer", "source"]
