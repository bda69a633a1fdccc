"""Request bodies over --max-request-bytes, over real HTTP against the real daemon: every common client
(urllib, requests, httpx, the OpenAI SDK), with a declared length and chunked, reads the OpenAI-shaped
413 instead of a reset connection, with no retry, and the daemon keeps serving afterwards. Then the
bounds on reading a refused body (bytes, time), at the ASGI level."""

from __future__ import annotations

import asyncio
import itertools
import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import httpx
import openai
import pytest
import requests
from starlette.responses import PlainTextResponse

from tests.daemon import PATIENCE, daemon
from v4serve.server.body import BodyLimit
from v4serve.server.errors import BodyTooLarge

MODEL = "v4serve-tiny"
COMPLETIONS = "/v1/completions"
LIMIT = 64 * 1024
# Over the limit, and more than the socket buffers on loopback take in: with a server that stops
# reading, a client that sends it all before reading fails on the send.
BIG = 6 * 1024 * 1024
JSON = {"Content-Type": "application/json"}
CHUNKED = pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with daemon("--max-request-bytes", str(LIMIT)) as base:
        yield base


def payload(size: int = BIG) -> bytes:
    return json.dumps({"model": MODEL, "prompt": "a" * size, "max_tokens": 1}).encode()


def pieces(body: bytes, size: int = 16 * 1024) -> Iterator[bytes]:
    """The body as an iterator, which every client here sends chunked (it has no length)."""
    for i in range(0, len(body), size):
        yield body[i:i + size]


def body_for(chunked: bool) -> bytes | Iterator[bytes]:
    return pieces(payload()) if chunked else payload()


def check_413(status: int, body: bytes, limit: int = LIMIT) -> None:
    assert status == 413, body[:300]
    error = json.loads(body)["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error", error
    assert f"{limit} bytes" in error["message"]


def assert_serving(url: str) -> None:
    r = httpx.post(url + COMPLETIONS, json={"model": MODEL, "prompt": "hi", "max_tokens": 1}, timeout=PATIENCE)
    assert r.status_code == 200, r.text


@CHUNKED
def test_urllib(url: str, chunked: bool) -> None:
    # http.client sends the whole body before it reads anything: the case that used to be a reset.
    request = urllib.request.Request(url + COMPLETIONS, data=body_for(chunked), headers=JSON)
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=PATIENCE)
    check_413(refused.value.code, refused.value.read())
    assert_serving(url)


@CHUNKED
def test_requests(url: str, chunked: bool) -> None:
    # urllib3 2 reads the response after a send that failed with a reset, and on Linux still finds a
    # 413 that came before it; urllib3 1 gives up on a reset, as http.client does.
    r = requests.post(url + COMPLETIONS, data=body_for(chunked), headers=JSON, timeout=PATIENCE)
    check_413(r.status_code, r.content)
    assert_serving(url)


@CHUNKED
def test_httpx(url: str, chunked: bool) -> None:
    r = httpx.post(url + COMPLETIONS, content=body_for(chunked), headers=JSON, timeout=PATIENCE)
    check_413(r.status_code, r.content)
    assert_serving(url)


class Chunks(httpx.SyncByteStream):
    def __init__(self, body: bytes) -> None:
        self.body = body

    def __iter__(self) -> Iterator[bytes]:
        yield from pieces(self.body)


@CHUNKED
def test_openai_sdk(url: str, chunked: bool) -> None:
    sent: list[httpx.Request] = []

    def on_request(request: httpx.Request) -> None:
        sent.append(request)
        if chunked:  # the SDK always declares a length; send the same JSON chunked instead
            body = request.read()
            del request.headers["Content-Length"]
            request.headers["Transfer-Encoding"] = "chunked"
            request.stream = Chunks(body)

    with httpx.Client(event_hooks={"request": [on_request]}) as http, \
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=2, http_client=http) as client:
        with pytest.raises(openai.APIStatusError) as refused:
            client.completions.create(model=MODEL, prompt="a" * BIG, max_tokens=1)
    assert refused.value.status_code == 413 and refused.value.code == "request_too_large"
    assert len(sent) == 1  # answered on the first try: no connection error, so no retry
    assert_serving(url)


def test_expect_continue_gets_the_413_without_sending_the_body(url: str) -> None:
    # curl asks for `100 Continue` before a large body and waits: it gets the 413 instead of the
    # go-ahead, and the connection closes (with nothing left unread, so it is not reset).
    address = urlsplit(url)
    head = (f"POST {COMPLETIONS} HTTP/1.1\r\nHost: {address.netloc}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {BIG}\r\nExpect: 100-continue\r\n\r\n")
    with socket.create_connection((address.hostname, address.port), timeout=PATIENCE) as s:
        s.sendall(head.encode())
        response = b""
        while chunk := s.recv(65536):  # until the server closes
            response += chunk
    status_line, _, rest = response.partition(b"\r\n")
    assert status_line.startswith(b"HTTP/1.1 413 "), response[:300]
    check_413(413, rest.partition(b"\r\n\r\n")[2])
    assert_serving(url)


# ---- the bounds on reading a refused body, at the ASGI level ---------------------------------------
SMALL, DRAIN = 10, 1000  # max_bytes and drain_bytes of the BodyLimit below


async def endpoint(scope: Any, receive: Any, send: Any) -> None:
    """Reads its whole body, and answers BodyTooLarge as the app's error handler does."""
    try:
        while (await receive()).get("more_body", False):
            pass
    except BodyTooLarge as exc:
        await exc.response()(scope, receive, send)
        return
    await PlainTextResponse("ok")(scope, receive, send)


def run_limit(headers: dict[bytes, bytes], reads: Iterator[dict[str, Any]],
              drain_seconds: float = 60) -> tuple[list[dict[str, Any]], int]:
    """BodyLimit(endpoint) on a fake connection whose reads come from `reads`; what it sent and how
    many reads it made."""
    sent: list[dict[str, Any]] = []
    count = 0

    async def receive() -> dict[str, Any]:
        nonlocal count
        count += 1
        await asyncio.sleep(0)
        return next(reads)

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": COMPLETIONS, "headers": list(headers.items())}
    limit = BodyLimit(endpoint, max_bytes=SMALL, drain_bytes=DRAIN, drain_seconds=drain_seconds)
    asyncio.run(asyncio.wait_for(limit(scope, receive, send), PATIENCE))  # only a guard against a hang
    return sent, count


def check_refused(sent: list[dict[str, Any]]) -> None:
    """A complete 413 that closes the connection."""
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 413
    assert (b"connection", b"close") in sent[0]["headers"]
    assert all(m["type"] == "http.response.body" for m in sent[1:]) and not sent[-1].get("more_body", False)
    check_413(413, b"".join(m.get("body", b"") for m in sent[1:]), limit=SMALL)


def parts(size: int, count: int | None = None) -> Iterator[dict[str, Any]]:
    """`count` reads of `size` bytes, the last one ending the body; endless without a count."""
    for i in itertools.count(1) if count is None else range(1, count + 1):
        yield {"type": "http.request", "body": b"x" * size, "more_body": i != count}


def test_a_declared_body_is_refused_first_then_read_to_its_end() -> None:
    sent, reads = run_limit({b"content-length": b"100"}, parts(10, count=10))
    check_refused(sent)
    assert sent[1]["more_body"] and sent[1]["body"]  # the whole 413 went out before the body was read
    assert reads == 10


@pytest.mark.parametrize("headers", [
    {b"content-length": str(SMALL + DRAIN + 1).encode()},  # reset either way: not worth reading
    {b"content-length": b"100", b"expect": b"100-continue"},  # the client sends nothing until told to
], ids=["past the bound", "expect 100-continue"])
def test_a_declared_body_that_is_not_read(headers: dict[bytes, bytes]) -> None:
    sent, reads = run_limit(headers, parts(10))
    check_refused(sent)
    assert reads == 0


def test_a_chunked_body_is_read_until_the_byte_bound() -> None:
    sent, reads = run_limit({}, parts(100))  # endless
    check_refused(sent)
    assert reads == (SMALL + DRAIN) // 100 + 1  # it stops at the first read past the bound


def test_a_stalled_body_is_cut_off_after_the_drain_time_limit() -> None:
    stalled = itertools.repeat({"type": "http.request", "body": b"", "more_body": True})
    sent, reads = run_limit({b"content-length": b"100"}, stalled, drain_seconds=0.2)
    check_refused(sent)
    assert reads > 0
