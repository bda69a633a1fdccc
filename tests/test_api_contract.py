"""The rest of the OpenAI contract: min_tokens, continuous usage stats, one model's card, streamed echo
with the prompt's logprobs and text offsets, and an OpenAPI description that tells the truth."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.daemon import PATIENCE

MODEL = "v4serve-tiny"


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=PATIENCE) as c:
        yield c


def events(http: httpx.Client, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with http.stream("POST", path, json={**body, "stream": True}) as resp:
        assert resp.status_code == 200
        lines = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_min_tokens_holds_back_eos_and_stop_tokens(http: httpx.Client) -> None:
    # With EOS the likeliest token at every step (a bias), a request stops at once unless min_tokens says not yet.
    eos = {"logit_bias": {"1": 100}, "prompt": "stop early", "max_tokens": 20, "temperature": 0}
    assert http.post("/v1/completions", json=eos).json()["usage"]["completion_tokens"] == 1
    held = http.post("/v1/completions", json={**eos, "min_tokens": 7}).json()
    assert held["usage"]["completion_tokens"] == 8 and held["choices"][0]["finish_reason"] == "stop"
    stop_id = http.post("/v1/completions", json={**eos, "logit_bias": {"70": 100}, "stop_token_ids": [70],
                                                  "min_tokens": 4}).json()
    assert stop_id["usage"]["completion_tokens"] == 5
    bad = http.post("/v1/completions", json={**eos, "min_tokens": 21})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "min_tokens"


def test_continuous_usage_stats(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "count me", "max_tokens": 5, "ignore_eos": True, "temperature": 0,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    chunks = events(http, "/v1/completions", body)
    with_text = [c for c in chunks if c["choices"]]
    assert all(c["usage"] is not None for c in with_text)
    completions = [c["usage"]["completion_tokens"] for c in with_text]
    assert completions == sorted(completions) and completions[-1] == 5
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 5
    plain = events(http, "/v1/completions", {**body, "stream_options": {"include_usage": True}})
    assert all(c["usage"] is None for c in plain if c["choices"])


def test_one_models_card(http: httpx.Client) -> None:
    card = http.get(f"/v1/models/{MODEL}").json()
    assert card["id"] == MODEL and card["object"] == "model"
    missing = http.get("/v1/models/no-such-model")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def test_streamed_echo_carries_the_prompts_logprobs_and_offsets(http: httpx.Client) -> None:
    body = {"model": MODEL, "prompt": "echo this prompt", "max_tokens": 4, "echo": True, "logprobs": 2,
            "temperature": 0, "ignore_eos": True}
    whole = http.post("/v1/completions", json=body).json()["choices"][0]
    chunks = [c["choices"][0] for c in events(http, "/v1/completions", body) if c["choices"]]
    assert "".join(c["text"] for c in chunks) == whole["text"]
    merged: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for c in chunks:
        for key in merged:
            merged[key] += c["logprobs"][key]
    assert merged == whole["logprobs"]
    assert merged["token_logprobs"][0] is None and merged["text_offset"][0] == 0
    assert merged["text_offset"] == sorted(merged["text_offset"])


def test_openapi_tells_the_statuses_this_server_returns(http: httpx.Client) -> None:
    spec = http.get("/openapi.json").json()
    operations = {f"{m.upper()} {p}": op for p, ops in spec["paths"].items() for m, op in ops.items()}
    assert not [name for name, op in operations.items() if "422" in op["responses"]]
    for name in ("POST /v1/chat/completions", "POST /v1/completions"):
        assert {"400", "401", "404", "413", "503"} <= set(operations[name]["responses"])
        error = operations[name]["responses"]["400"]["content"]["application/json"]["schema"]
        assert error == {"$ref": "#/components/schemas/ErrorResponse"}
    assert set(spec["components"]["schemas"]["ErrorBody"]["properties"]) == {"message", "type", "param", "code"}
    assert "text/plain" in operations["GET /metrics"]["responses"]["200"]["content"]
    body = operations["POST /v1/chat/completions"]["requestBody"]["content"]["application/json"]["schema"]
    assert body == {"$ref": "#/components/schemas/ChatCompletionRequest"}


def test_wrong_method_is_405_with_allow(http: httpx.Client) -> None:
    resp = http.get("/v1/chat/completions")
    assert resp.status_code == 405 and resp.headers["allow"] == "POST"
    assert set(resp.json()["error"]) == {"message", "type", "param", "code"}


def test_tokenize_and_detokenize_document_examples_that_work(http: httpx.Client) -> None:
    schemas = http.get("/openapi.json").json()["components"]["schemas"]
    for path, model in (("/tokenize", "TokenizeRequest"), ("/detokenize", "DetokenizeRequest")):
        examples = schemas[model]["examples"]
        assert examples
        for example in examples:
            reply = http.post(path, json=example)
            assert reply.status_code == 200, (path, example, reply.text)
    assert http.post("/tokenize", json={"text": "x"}).json()["error"]["param"] == "text"  # prompt, not text


def test_line_separators_in_streamed_text_do_not_cut_an_event(http: httpx.Client) -> None:
    """U+2028, U+2029 and U+0085 may stand raw in JSON, but line readers that split as str.splitlines does
    (httpx's `iter_lines`, used by `events` here) end a line there: they go out escaped, and every event of
    every API parses whole."""
    text = "a\u2028b\x85c\u2029d"
    chunks = events(http, "/v1/completions", {"prompt": text, "echo": True, "max_tokens": 2, "temperature": 0})
    assert "".join(c["choices"][0]["text"] for c in chunks).startswith(text)
    chat = events(http, "/v1/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2})
    assert chat[0]["choices"][0]["delta"]["role"] == "assistant"
    with http.stream("POST", "/v1/messages", json={"model": MODEL, "max_tokens": 2, "stream": True,
                                                    "messages": [{"role": "user", "content": text}]}) as resp:
        data = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    assert [json.loads(d)["type"] for d in data][0] == "message_start"


def test_every_event_writer_escapes_what_line_splitters_break_at() -> None:
    from v4serve.server.framing import Chunker, event, typed_event

    text = "x\u2028y\u2029z\x85w"
    chunker = Chunker("id", "text_completion", 0, MODEL, False)
    for written in (event({"text": text}), typed_event("delta", {"text": text}), chunker([{"text": text}])):
        assert written.endswith("\n\n")
        lines = written.splitlines()  # as a splitlines reader sees it: the SSE lines, no more
        assert lines == written[:-1].split("\n")
        (data,) = (line[6:] for line in lines if line.startswith("data: "))
        assert text in json.dumps(json.loads(data), ensure_ascii=False)
