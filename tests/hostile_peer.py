"""A hostile prefill replica for tests/test_hostile.py: an HTTP server at an address a decode replica lists
as a producer, which answers hand-over requests as a broken or malicious peer would — a real hand-over's
manifest replayed with its files' KV zeroed (their checksums made again), a manifest that never ends, one
with a negative size, one dripped a byte at a time — proving its answers with whatever secret it is given
(the fleet's, or another). It counts what it sent and what it was asked, so a test can say what a decode
replica read and for how long it held on."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from v4serve.cache.kv_transfer import PATH
from v4serve.cache.peer_auth import PEER_HEADER, REPLY_HEADER, file_mac, reply_proof
from v4serve.cache.ssd_file import _HEAD, encode, file_tokens


@dataclass
class Served:
    """What the hostile producer was asked and sent, per transfer id."""

    manifests: int = 0
    files_requests: int = 0
    bytes_sent: int = 0
    closed_by_peer: bool = False  # the decode replica hung up while it was still sending


@dataclass
class HandOver:
    """How the hostile producer answers for one transfer id: `mode` and, for the replays, the real hand-over
    (its folder on a real producer's disk)."""

    mode: str  # "zeroed", "replay" (the files as they are), "endless", "negative_size", "drip"
    folder: Path | None = None
    served: Served = field(default_factory=Served)


def zeroed(data: bytes) -> bytes:
    """A store file with every payload byte zero and its checksum made again: every check a file makes
    passes, only the values are wrong."""
    fields = _HEAD.unpack_from(data)
    n_tok, n_layout, n_payload = fields[5:8]
    layout = data[_HEAD.size + 4 * n_tok:_HEAD.size + 4 * n_tok + n_layout]
    return b"".join(bytes(p) for p in encode(fields[2], fields[3], fields[4], file_tokens(data), layout,
                                             [bytes(n_payload)]))


class HostileProducer:
    """Serves `handovers[transfer_id]`, proving answers with `secret`."""

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self.handovers: dict[str, HandOver] = {}
        self.stop = threading.Event()
        producer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:  # noqa: N802 - http.server's names
                producer.manifest(self)

            def do_POST(self) -> None:  # noqa: N802
                producer.files(self)

            def do_DELETE(self) -> None:  # noqa: N802
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.stop.set()
        self.server.shutdown()
        self.server.server_close()

    # ---- answers -------------------------------------------------------------------------------------------
    def _nonce(self, handler: BaseHTTPRequestHandler) -> str:
        proof = handler.headers.get(PEER_HEADER, "")
        return proof.split(" n=", 1)[1].split(" ", 1)[0] if " n=" in proof else ""

    def _handover(self, handler: BaseHTTPRequestHandler) -> HandOver:
        transfer_id = handler.path.removeprefix(PATH).split("?")[0].split("/")[0]
        return self.handovers[transfer_id]

    def _send(self, handler: BaseHTTPRequestHandler, served: Served, chunks: Callable[[], Any],
              headers: dict[str, str]) -> None:
        handler.send_response(200)
        for name, value in headers.items():
            handler.send_header(name, value)
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")  # each answer on a connection of its own, as some proxies do
        handler.end_headers()
        try:
            for chunk in chunks():
                if self.stop.is_set():
                    return
                handler.wfile.write(f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n")
                handler.wfile.flush()
                served.bytes_sent += len(chunk)
            handler.wfile.write(b"0\r\n\r\n")
        except OSError:
            served.closed_by_peer = True
        handler.close_connection = True

    def manifest(self, handler: BaseHTTPRequestHandler) -> None:
        handover = self._handover(handler)
        served, nonce = handover.served, self._nonce(handler)
        served.manifests += 1
        mode = handover.mode
        if mode in ("zeroed", "replay", "negative_size"):
            assert handover.folder is not None
            manifest = json.loads((handover.folder / "manifest.json").read_text())
            if mode == "negative_size":
                manifest["files"][0]["size"] = -1
            body = json.dumps(manifest).encode()
            self._send(handler, served, lambda: [body], {REPLY_HEADER: reply_proof(self.secret, nonce, body)})
        elif mode == "endless":  # a JSON list that never closes, as fast as the peer reads it
            def endless() -> Any:
                yield b'{"files": ['
                entry = b'{"kind": 1, "key": "' + b"0" * 64 + b'", "name": "x", "size": 1},' * 256
                while not self.stop.is_set():
                    yield entry
            self._send(handler, served, endless, {REPLY_HEADER: "0" * 64})
        elif mode == "drip":  # a byte at a time, never the end
            def drip() -> Any:
                for byte in iter(lambda: b"{", None):
                    time.sleep(0.2)
                    yield byte
            self._send(handler, served, drip, {REPLY_HEADER: "0" * 64})

    def files(self, handler: BaseHTTPRequestHandler) -> None:
        handover = self._handover(handler)
        served, nonce = handover.served, self._nonce(handler)
        served.files_requests += 1
        names = json.loads(handler.rfile.read(int(handler.headers.get("Content-Length", "0"))))["names"]
        assert handover.folder is not None

        def chunks() -> Any:
            for index, name in enumerate(names):
                data = (handover.folder / name).read_bytes()
                if handover.mode == "zeroed":
                    data = zeroed(data)
                mac = file_mac(self.secret, nonce, index, name)
                mac.update(data)
                yield data + mac.digest()
        self._send(handler, served, chunks, {})


@contextlib.contextmanager
def hostile_producer(secret: bytes) -> Any:
    producer = HostileProducer(secret)
    try:
        yield producer
    finally:
        producer.close()
