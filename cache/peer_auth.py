"""Which replicas may hand KV to each other: those holding the fleet's peer secret
(`kv_connector_extra_config.peer_secret`), which no client holds. Plain Python, no torch.

The secret itself never crosses the network. A decode replica's request carries an HMAC-SHA256 over its
method, target, the body's digest, the time and a fresh nonce (`PEER_HEADER`); a prefill replica answers
only a request whose proof checks, stamped within `SKEW_SECONDS` of its own clock, each nonce once. The
answers are proven the same way and bound to the request's nonce: the manifest by a header
(`REPLY_HEADER`), every file by a MAC sent after its bytes. So a decode replica imports only what a holder
of the secret sent in answer to this very request, not what another process listening at a producer's
address (or a replayed answer) sends.

What it does not give: secrecy (the KV crosses in the clear, so keep the fleet's traffic on a private
network or under a mesh's mTLS), and any defence against a replica that holds the secret (trusting the
operator's own replicas is the operator's choice, not a client's).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

PEER_HEADER = "x-v4serve-peer"  # a request's proof: "v1 t=<unix seconds> n=<nonce> d=<body's SHA-256> mac=<hex>"
REPLY_HEADER = "x-v4serve-peer-reply"  # the manifest's proof, bound to the request's nonce
MAC_BYTES = 32  # after each file in a files reply
SKEW_SECONDS = 120.0  # how far a request's stamp may be from the producer's clock, either way
MIN_SECRET_BYTES = 16
_PROOF = re.compile(r"v1 t=(\d{1,12}) n=([0-9a-f]{32}) d=([0-9a-f]{64}) mac=([0-9a-f]{64})")


class PeerRefused(Exception):
    """A request or answer whose proof does not check (the message says how, never the secret)."""


def _mac(secret: bytes, *parts: bytes) -> hmac.HMAC:
    mac = hmac.new(secret, digestmod=hashlib.sha256)
    for part in parts:  # length-prefixed: no two sequences of parts give the same bytes
        mac.update(len(part).to_bytes(8, "little"))
        mac.update(part)
    return mac


def _request_mac(secret: bytes, method: str, target: str, digest: str, stamp: int, nonce: str) -> str:
    return _mac(secret, b"v4serve-peer-request-1", method.encode(), target.encode(), digest.encode(),
                str(stamp).encode(), nonce.encode()).hexdigest()


def body_digest(body: bytes) -> str:
    return hashlib.sha256(body).hexdigest()


def request_proof(secret: bytes, method: str, target: str, body: bytes = b"") -> tuple[str, str]:
    """(the PEER_HEADER value for this request, its nonce) — `target` is the path with its query. The
    body's digest is in the proof, so a producer checks the proof before it reads any body."""
    stamp, nonce, digest = int(time.time()), secrets.token_hex(16), body_digest(body)
    mac = _request_mac(secret, method, target, digest, stamp, nonce)
    return f"v1 t={stamp} n={nonce} d={digest} mac={mac}", nonce


def reply_proof(secret: bytes, nonce: str, body: bytes) -> str:
    """The REPLY_HEADER value a producer sends with a manifest."""
    return _mac(secret, b"v4serve-peer-reply-1", nonce.encode(), body).hexdigest()


def check_reply(secret: bytes, nonce: str, body: bytes, proof: str | None) -> None:
    if not hmac.compare_digest(reply_proof(secret, nonce, body), proof or ""):
        raise PeerRefused("the manifest's answer is not proven with the peer secret")


def file_mac(secret: bytes, nonce: str, index: int, name: str) -> hmac.HMAC:
    """The MAC of the `index`-th file of a files reply, to be fed the file's bytes (both sides)."""
    return _mac(secret, b"v4serve-peer-file-1", nonce.encode(), str(index).encode(), name.encode())


class NonceWindow:
    """Nonces of requests accepted within the skew window, so none is accepted twice. Only requests
    whose MAC checked are entered, so only holders of the secret can fill it; past `capacity` the
    oldest go first."""

    def __init__(self, capacity: int = 1 << 18) -> None:  # ~30 MB full: 1,000 requests a second for 240 s
        self.capacity = capacity
        self._seen: OrderedDict[str, float] = OrderedDict()
        self._lock = threading.Lock()

    def first_use(self, nonce: str, now: float) -> bool:
        with self._lock:
            while self._seen and (next(iter(self._seen.values())) < now - 2 * SKEW_SECONDS
                                  or len(self._seen) >= self.capacity):
                self._seen.popitem(last=False)
            if nonce in self._seen:
                return False
            self._seen[nonce] = now
            return True


@dataclass(frozen=True)
class Proven:
    """A request whose proof checked: its nonce (its answers are proven for it) and the digest its body
    must have (`check_body`, once the body is read)."""

    nonce: str
    digest: str

    def check_body(self, body: bytes) -> None:
        if not hmac.compare_digest(body_digest(body), self.digest):
            raise PeerRefused(f"the body is not the one the {PEER_HEADER} proof was made for")


def check_request(secret: bytes, method: str, target: str, proof: str | None, seen: NonceWindow) -> Proven:
    """The request's nonce and body digest if its proof checks; PeerRefused naming what is wrong
    otherwise. Nothing of the body is needed: it is read only after this, and then `Proven.check_body`."""
    found = _PROOF.fullmatch(proof or "")
    if found is None:
        raise PeerRefused(f"no {PEER_HEADER} proof: these endpoints answer only replicas holding the peer secret")
    stamp, nonce, digest, mac = int(found.group(1)), found.group(2), found.group(3), found.group(4)
    if not hmac.compare_digest(_request_mac(secret, method, target, digest, stamp, nonce), mac):
        raise PeerRefused(f"the {PEER_HEADER} proof does not check (another peer secret, or the request was changed)")
    now = time.time()
    if abs(now - stamp) > SKEW_SECONDS:
        raise PeerRefused(f"the {PEER_HEADER} proof is stamped {now - stamp:+.0f} s from this replica's clock "
                          f"(at most {SKEW_SECONDS:g} s either way: are the clocks synchronised?)")
    if not seen.first_use(nonce, now):
        raise PeerRefused(f"the {PEER_HEADER} proof was used before (a replayed request)")
    return Proven(nonce, digest)
