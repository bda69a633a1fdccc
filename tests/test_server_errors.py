"""Bad requests against the real daemon: the right status, OpenAI's error body, and a server that keeps
serving afterwards; plus `--api-key` on a second daemon."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.daemon import PATIENCE, daemon

MODEL = "v4serve-tiny"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
KEY = "sekret"


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=PATIENCE) as c:
        yield c


@pytest.fixture(scope="module")
def secured_url() -> Iterator[str]:
    with daemon("--api-key", KEY) as url:
        yield url


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def check_error(resp: httpx.Response, status: int, param: str | None = None, code: str | None = None) -> dict:
    """The status and OpenAI's `{"error": {"message", "type", "param", "code"}}` body."""
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str) and err["type"]
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def assert_serving(http: httpx.Client) -> None:
    r = http.post(CHAT, json={"model": MODEL, "messages": user("still there?"), "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": user("hello"), "max_tokens": 4, **fields}


# (path, JSON body, status, param or None to skip that check, code or None to skip)
BAD_REQUESTS: dict[str, tuple[str, Any, int, str | None, str | None]] = {
    "missing messages": (CHAT, {"model": MODEL, "max_tokens": 4}, 400, "messages", None),
    "empty messages": (CHAT, chat(messages=[]), 400, "messages", None),
    "messages not a list": (CHAT, chat(messages="hello"), 400, None, None),
    "max_tokens string": (CHAT, chat(max_tokens="x"), 400, "max_tokens", None),
    "max_tokens zero": (CHAT, chat(max_tokens=0), 400, "max_tokens", None),
    "temperature string": (CHAT, chat(temperature="hot"), 400, "temperature", None),
    "temperature too high": (CHAT, chat(temperature=7), 400, "temperature", None),
    "top_logprobs 21": (CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs", None),
    "n zero": (CHAT, chat(n=0), 400, "n", None),
    "unknown role": (CHAT, chat(messages=[{"role": "wizard", "content": "hi"}]), 400, None, None),
    "role missing": (CHAT, chat(messages=[{"content": "hi"}]), 400, None, None),
    "stream_options without stream": (CHAT, chat(stream_options={"include_usage": True}), 400, None, None),
    "stop_token_ids out of vocab": (CHAT, chat(stop_token_ids=[99999]), 400, "stop_token_ids", None),
    "logit_bias out of vocab": (CHAT, chat(logit_bias={"99999": 1.0}), 400, "logit_bias", None),
    "body is a list": (CHAT, [1, 2, 3], 400, None, None),
    "completion prompt missing": (COMPLETIONS, {"model": MODEL}, 400, "prompt", None),
    "completion prompt empty list": (COMPLETIONS, {"model": MODEL, "prompt": []}, 400, "prompt", None),
    "completion token id out of vocab": (COMPLETIONS, {"model": MODEL, "prompt": [1, 99999]}, 400, "prompt", None),
    "completion logprobs 21": (COMPLETIONS, {"model": MODEL, "prompt": "a", "logprobs": 21}, 400, "logprobs", None),
    "completion n zero": (COMPLETIONS, {"model": MODEL, "prompt": "a", "n": 0}, 400, "n", None),
}


@pytest.mark.parametrize("case", list(BAD_REQUESTS))
def test_bad_request(http: httpx.Client, case: str) -> None:
    path, body, status, param, code = BAD_REQUESTS[case]
    check_error(http.post(path, json=body), status, param, code)
    assert_serving(http)


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_invalid_json(http: httpx.Client, path: str) -> None:
    resp = http.post(path, content=b'{"model": "v4serve-tiny", "messages": [',
                     headers={"content-type": "application/json"})
    check_error(resp, 400)
    assert_serving(http)


def test_unknown_route_and_method(http: httpx.Client) -> None:
    check_error(http.get("/v1/nope"), 404)
    check_error(http.get(CHAT), 405)
    assert_serving(http)


def test_context_length_exceeded(http: httpx.Client) -> None:
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    long_text = "a" * (limit + 10)
    check_error(http.post(CHAT, json=chat(messages=user(long_text))), 400, code="context_length_exceeded")
    check_error(http.post(COMPLETIONS, json={"model": MODEL, "prompt": long_text, "max_tokens": 4}), 400,
                code="context_length_exceeded")
    # A short prompt whose completion budget does not fit either.
    check_error(http.post(COMPLETIONS, json={"model": MODEL, "prompt": "short", "max_tokens": limit}), 400,
                code="context_length_exceeded")
    check_error(http.post(COMPLETIONS, json={"model": MODEL, "prompt": long_text, "max_tokens": 4, "stream": True}),
                400, code="context_length_exceeded")
    assert_serving(http)


def test_context_length_exceeded_streaming_chat(http: httpx.Client) -> None:
    """A streamed chat request that cannot fit is refused up front, like the non-streamed one."""
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    resp = http.post(CHAT, json=chat(messages=user("a" * (limit + 10)), stream=True))
    check_error(resp, 400, code="context_length_exceeded")
    assert_serving(http)


def test_openai_sdk_errors(base_url: str, http: httpx.Client) -> None:
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0) as client:
        with pytest.raises(openai.NotFoundError) as nf:
            client.chat.completions.create(model="no-such-model", messages=user("hi"), max_tokens=2)
        assert nf.value.status_code == 404
        assert nf.value.code == "model_not_found" and nf.value.param == "model"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)
        with pytest.raises(openai.BadRequestError) as bad:
            client.chat.completions.create(model=MODEL, messages=user("hi"), logprobs=True, top_logprobs=21)
        assert bad.value.status_code == 400 and bad.value.param == "top_logprobs"
        ok = client.chat.completions.create(model=MODEL, messages=user("hi"), max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
    check_error(http.post("/tokenize", json={"model": "no-such-model", "prompt": "x"}), 404, code="model_not_found")
    check_error(http.post("/tokenize", json={"prompt": "x", "messages": user("x")}), 400)
    check_error(http.post("/detokenize", json={"tokens": [-1]}), 400, param="tokens")
    assert_serving(http)


def test_api_key(secured_url: str) -> None:
    with httpx.Client(base_url=secured_url, timeout=PATIENCE) as http:
        body = chat()
        check_error(http.post(CHAT, json=body), 401, code="invalid_api_key")
        check_error(http.get("/v1/models"), 401)
        check_error(http.post(CHAT, json=body, headers={"Authorization": "Bearer wrong"}), 401)
        check_error(http.post("/reset_prefix_cache"), 401)
        assert http.get("/health").status_code == 200
        ok = http.post(CHAT, json=body, headers={"Authorization": f"Bearer {KEY}"})
        assert ok.status_code == 200 and ok.json()["object"] == "chat.completion"
    with openai.OpenAI(base_url=secured_url + "/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError):
            client.models.list()
    with openai.OpenAI(base_url=secured_url + "/v1", api_key=KEY, max_retries=0) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        r = client.completions.create(model=MODEL, prompt="hi", max_tokens=2)
        assert json.loads(r.model_dump_json())["usage"]["completion_tokens"] >= 1


def test_api_key_guards_every_route_but_the_probes(secured_url: str) -> None:
    with httpx.Client(base_url=secured_url, timeout=PATIENCE) as http:
        for method, path in (("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/version"),
                             ("GET", "/openapi.json"), ("GET", "/docs"), ("GET", "/no/such/route")):
            check_error(http.request(method, path, json={"prompt": "x", "tokens": [70]}), 401, code="invalid_api_key")
        assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        keyed = {"Authorization": f"Bearer {KEY}"}
        assert http.post("/tokenize", json={"prompt": "x"}, headers=keyed).status_code == 200
    with daemon("--api-key", KEY, "--protect-metrics") as url:
        check_error(httpx.get(url + "/metrics", timeout=PATIENCE), 401, code="invalid_api_key")
        authorized = httpx.get(url + "/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=PATIENCE)
        assert authorized.status_code == 200
        assert httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
