"""The HTTP side of prefill and decode on separate replicas (`cache/kv_transfer.py` has the rest): what
a request's `kv_transfer_params` ask of this replica, the `kv_transfer_params` a prefill replica's reply
carries, and the endpoints decode replicas fetch hand-overs from.

The protocol is vLLM's, as its router drives it: the prefill leg carries `{"do_remote_decode": true}`
and `max_tokens: 1`; its reply's `kv_transfer_params` say where the KV is (`remote_host`,
`remote_port`, `remote_request_id`, plus v4serve's `signature`); the decode leg is the original request
with those params (`do_remote_prefill: true`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from v4serve.cache.kv_transfer import PATH, TRANSFER_ID, KVSource, KVTransferConfig, new_transfer_id, signature
from v4serve.cache.ssd_store import HANDOVER_DIR, MANIFEST
from v4serve.server.errors import ApiError
from v4serve.server.protocol import note_once

log = logging.getLogger(__name__)

READ_CHUNK = 1 << 20  # bytes of a hand-over file read at a time while it is sent
MANIFEST_POLL = 0.005  # seconds between looks for a hand-over's manifest


@dataclass(frozen=True)
class Handovers:
    """This replica's role in hand-overs, and where its own are."""

    config: KVTransferConfig
    store_root: Path
    host: str  # where decode replicas reach this one
    port: int
    secret: str | None  # what the address is signed with (the daemons' shared API key)

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
                "remote_request_id": transfer_id, "signature": signature(self.secret, transfer_id, self.host,
                                                                         self.port)}

    def manifest(self, transfer_id: str) -> dict[str, Any]:
        if not self.config.producer:
            raise ApiError(404, "this replica hands no KV over (--kv-transfer-config kv_role)", code="not_found")
        try:
            return json.loads((self.folder(transfer_id) / MANIFEST).read_text())
        except (OSError, ValueError) as exc:
            raise ApiError(404, f"no hand-over {transfer_id} here (fetched already, or older than "
                                f"{self.config.hold_seconds:g} s)", code="not_found") from exc

    async def manifest_when_made(self, transfer_id: str, wait: float) -> dict[str, Any]:
        """The manifest, waiting up to `wait` seconds for it to be made (SGLang's router sends the decode
        leg as the prefill leg starts; vLLM's only once it has ended, when it is there already)."""
        deadline = time.monotonic() + wait
        while not (self.folder(transfer_id) / MANIFEST).is_file() and time.monotonic() < deadline:
            await asyncio.sleep(MANIFEST_POLL * 4)
        return self.manifest(transfer_id)

    def files(self, transfer_id: str, names: Any, sent: Any, sent_bytes: Any) -> Iterator[bytes]:
        """The named files of a hand-over, back to back in the order asked (each must be in its
        manifest); once all are sent the hand-over is dropped. `sent`/`sent_bytes`: metric series."""
        listed = {e["name"] for e in self.manifest(transfer_id)["files"]}
        if not isinstance(names, list) or not all(isinstance(n, str) and n in listed for n in names):
            raise ApiError(400, "names must list files of the hand-over's manifest", param="names")
        folder = self.folder(transfer_id)
        handles = [open(folder / n, "rb") for n in names]  # noqa: SIM115 - closed by the generator
        return self._send(folder, handles, sent, sent_bytes)

    @staticmethod
    def _send(folder: Path, handles: list[Any], sent: Any, sent_bytes: Any) -> Iterator[bytes]:
        try:
            for f in handles:
                while chunk := f.read(READ_CHUNK):
                    sent_bytes.inc(len(chunk))
                    yield chunk
        finally:
            for f in handles:
                f.close()
        sent.inc()
        shutil.rmtree(folder, ignore_errors=True)  # fetched: held no longer


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
        return transfer_id, None
    if handovers.config.consumer:
        return None, KVSource(host, port, transfer_id, wait=True)
    return None, None


def request_transfer(handovers: Handovers | None, params: dict[str, Any] | None, stream: bool,
                     prompts: int) -> tuple[str | None, KVSource | None]:
    """(the transfer id to hand this request's KV over under, the prefill replica to fetch it from) as
    its `kv_transfer_params` ask and this replica's role allows; a request a replica cannot serve that
    way is computed as any other (logged once), never refused."""
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
            return new_transfer_id(), None
        return None, None
    if params.get("do_remote_prefill"):
        if handovers is None or not handovers.config.consumer:
            note_once("pd-not-consumer", "a request names a hand-over to fetch, but this replica is no decode replica "
                      "(--kv-transfer-config kv_role kv_consumer or kv_both): it computes the prompt",
                      level=logging.WARNING)
            return None, None
        return None, source(params)
    return None, None


def source(params: dict[str, Any]) -> KVSource | None:
    """The prefill replica a decode leg's params name (None: it names none; the prompt is computed)."""
    host, port, transfer_id = params.get("remote_host"), params.get("remote_port"), params.get("remote_request_id")
    if host is None and transfer_id is None:
        return None
    sig = params.get("signature")
    if (not isinstance(host, str) or not host or isinstance(port, bool) or not isinstance(port, int)
            or not 0 < port < 65536 or not isinstance(transfer_id, str) or not TRANSFER_ID.fullmatch(transfer_id)
            or (sig is not None and not isinstance(sig, str))):
        raise ApiError(400, "kv_transfer_params must name remote_host, remote_port and a remote_request_id from a "
                            "v4serve prefill replica's reply", param="kv_transfer_params")
    return KVSource(host, port, transfer_id, sig)


__all__ = ["PATH", "Handovers", "request_transfer", "sglang_transfer", "source"]
