"""End-to-end tests of the OpenAI-compatible daemon: the real `v4serve serve` under uvicorn, driven by the
official `openai` SDK (httpx where the SDK cannot express the request or hides the wire format).

The embedded model has random weights, so its outputs are arbitrary bytes: runs are only ever compared
with each other (at temperature 0 where they must match), never with hard-coded text.
"""

from __future__ import annotations

import asyncio
import json
import math
import re
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.daemon import PATIENCE, daemon
from v4serve.server.text.tokenizer import INPUT_ONLY_SPECIALS

MODEL = "v4serve-tiny"
GREEDY: dict[str, Any] = {"temperature": 0.0}
NO_EOS: dict[str, Any] = {"extra_body": {"ignore_eos": True}}


# ---- fixtures -------------------------------------------------------------------------------------------
ALIASES = ("deepseek-chat", "deepseek-reasoner")


@pytest.fixture(scope="module")
def base_url() -> Iterator[str]:
    """The daemon of this module: the tiny model under its own name and two of DeepSeek's."""
    with daemon("--served-model-name", MODEL, *ALIASES) as url:
        yield url


@pytest.fixture(scope="module")
def client(base_url: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=PATIENCE) as c:
        yield c


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=PATIENCE) as c:
        yield c


# ---- helpers ----------------------------------------------------------------------------------------------
def fresh(text: str = "") -> str:
    """A prompt no earlier request shared a prefix with (so its cache state is known)."""
    return f"{uuid.uuid4().hex} {text}"


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def sse_events(resp: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order (including the final `[DONE]`)."""
    out = []
    for line in resp.iter_lines():
        if not line:
            continue
        assert line.startswith("data: "), f"unexpected SSE line {line!r}"
        out.append(line[len("data: "):])
    return out


def metric(http: httpx.Client, name: str, **labels: str) -> float:
    """One sample of /metrics (labels given must all match)."""
    text = http.get("/metrics").text
    for line in text.splitlines():
        m = re.match(r"^([a-zA-Z_:][\w:]*)(\{[^}]*\})? (\S+)$", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    raise AssertionError(f"metric {name}{labels} not found in /metrics")


def wait_for_metric(http: httpx.Client, name: str, value: float, timeout: float = PATIENCE) -> None:
    deadline = time.monotonic() + timeout
    while (got := metric(http, name)) != value:
        assert time.monotonic() < deadline, f"{name} stayed at {got}, expected {value} within {timeout}s"
        time.sleep(0.1)


def check_usage(usage: dict[str, Any]) -> None:
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int) and 0 <= cached <= usage["prompt_tokens"]
    assert usage["prompt_cache_hit_tokens"] == cached
    assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]


def chat_tokens(logprobs: Any) -> list[tuple[bytes, float]]:
    """(token bytes, logprob) of each generated token of a chat choice's logprobs."""
    return [(bytes(t.bytes), t.logprob) for t in logprobs.content]


def same_tokens(a: list[tuple[Any, float]], b: list[tuple[Any, float]], tol: float = 1e-3) -> None:
    assert [t for t, _ in a] == [t for t, _ in b]
    for (_, x), (_, y) in zip(a, b, strict=True):
        assert math.isclose(x, y, abs_tol=tol), (x, y)


def pick_stop(text: str) -> str:
    """A two-character stop string (no U+FFFD, which is lossy), from the second half of `text` if it
    has one (the random model's bytes are often invalid UTF-8), else from anywhere after the start."""
    for i in [*range(len(text) // 2, len(text) - 1), *range(1, len(text) // 2)]:
        piece = text[i:i + 2]
        if "\ufffd" not in piece:
            return piece
    raise AssertionError(f"no usable stop string in {text!r}")


def stream_chat(client: openai.OpenAI, **kwargs: Any) -> tuple[dict[int, str], dict[int, list], dict[int, str]]:
    """Joined content, logprob entries and finish reason per choice index of a streamed chat."""
    text: dict[int, str] = {}
    lps: dict[int, list] = {}
    finish: dict[int, str] = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for c in chunk.choices:
            text[c.index] = text.get(c.index, "") + (c.delta.content or "")
            if c.logprobs is not None and c.logprobs.content:
                lps.setdefault(c.index, []).extend(c.logprobs.content)
            if c.finish_reason is not None:
                assert c.index not in finish, "two finish reasons for one choice"
                finish[c.index] = c.finish_reason
    return text, lps, finish


# ---- basic shape ------------------------------------------------------------------------------------------
def test_chat_basic_shape(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=user(fresh("hi")), max_tokens=8, **GREEDY)
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion" and r.model == MODEL
    assert isinstance(r.created, int) and r.created > 1_600_000_000
    assert len(r.choices) == 1
    c = r.choices[0]
    assert c.index == 0 and c.message.role == "assistant" and isinstance(c.message.content, str)
    assert c.finish_reason in ("stop", "length")
    usage = r.usage.model_dump()
    check_usage(usage)
    assert usage["prompt_tokens"] > 0 and 1 <= usage["completion_tokens"] <= 8
    assert usage["prompt_tokens_details"]["cached_tokens"] == 0  # a fresh prompt


def test_completion_basic_shape(client: openai.OpenAI) -> None:
    prompt = fresh("once upon a time")
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=5, **GREEDY, **NO_EOS)
    assert r.id.startswith("cmpl-") and r.object == "text_completion" and r.model == MODEL
    assert len(r.choices) == 1 and r.choices[0].index == 0 and isinstance(r.choices[0].text, str)
    assert r.choices[0].finish_reason == "length"
    usage = r.usage.model_dump()
    check_usage(usage)
    assert usage["completion_tokens"] == 5
    assert usage["prompt_tokens"] == len(prompt.encode()) + 1  # byte tokenizer plus BOS


# ---- streaming equals non-streaming -------------------------------------------------------------------------
def test_chat_stream_equals_nonstream(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=user(fresh("stream me")), max_tokens=48, logprobs=True, top_logprobs=2,
                **GREEDY, **NO_EOS)
    full = client.chat.completions.create(**args)
    text, lps, finish = stream_chat(client, **args)
    assert text[0] == full.choices[0].message.content
    assert finish[0] == full.choices[0].finish_reason == "length"
    want = chat_tokens(full.choices[0].logprobs)
    assert len(want) == 48
    got = [(bytes(t.bytes), t.logprob) for t in lps[0]]
    same_tokens(got, want)


def test_completion_stream_equals_nonstream(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt=fresh("stream me too"), max_tokens=48, logprobs=1, **GREEDY, **NO_EOS)
    full = client.completions.create(**args)
    text, tokens, finish = "", [], None
    for chunk in client.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += list(zip(c.logprobs.tokens, c.logprobs.token_logprobs, strict=True))
            if c.finish_reason is not None:
                finish = c.finish_reason
    assert text == full.choices[0].text
    assert finish == full.choices[0].finish_reason == "length"
    want = list(zip(full.choices[0].logprobs.tokens, full.choices[0].logprobs.token_logprobs, strict=True))
    assert len(want) == 48
    same_tokens(tokens, want)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_stream_include_usage(http: httpx.Client, endpoint: str) -> None:
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    if endpoint == "chat":
        body["messages"] = user(fresh("usage please"))
    else:
        body["prompt"] = fresh("usage please")
    plain = http.post(path, json=body).json()
    with http.stream("POST", path, json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(resp)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert len(chunks) >= 2
    for chunk in chunks[:-1]:
        assert "usage" in chunk and chunk["usage"] is None, chunk
        assert len(chunk["choices"]) == 1
    last = chunks[-1]
    assert last["choices"] == []
    usage = last["usage"]
    check_usage(usage)
    assert usage["completion_tokens"] == 6
    assert usage["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert len({c["id"] for c in chunks}) == 1


def test_completion_stream_usage_counts_every_prompt(http: httpx.Client) -> None:
    """Streamed usage of a multi-prompt completion must count every prompt, as the non-streamed one does."""
    body = {"model": MODEL, "prompt": [fresh("first"), fresh("second, longer prompt")], "max_tokens": 3,
            "temperature": 0, "ignore_eos": True}
    plain = http.post("/v1/completions", json=body).json()["usage"]
    with http.stream("POST", "/v1/completions",
                     json={**body, "stream": True, "stream_options": {"include_usage": True}}) as resp:
        streamed = json.loads(sse_events(resp)[-2])["usage"]
    check_usage(streamed)
    assert streamed["completion_tokens"] == plain["completion_tokens"] == 6
    assert streamed["prompt_tokens"] == plain["prompt_tokens"]


# ---- n, stop, length, seed ----------------------------------------------------------------------------------
def test_n2_greedy_choices_equal(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=user(fresh("two of them")), max_tokens=12, n=2, **GREEDY, **NO_EOS)
    r = client.chat.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.choices[0].message.content == r.choices[1].message.content
    assert r.usage.completion_tokens == 24
    text, _, finish = stream_chat(client, **args)
    assert text == {0: r.choices[0].message.content, 1: r.choices[0].message.content}
    assert finish == {0: "length", 1: "length"}

    c = client.completions.create(model=MODEL, prompt=fresh("two"), max_tokens=12, n=2, **GREEDY, **NO_EOS)
    assert [x.index for x in c.choices] == [0, 1] and c.choices[0].text == c.choices[1].text


def test_stop_string_chat(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=user(fresh("stop somewhere")), max_tokens=64, **GREEDY, **NO_EOS)
    ref = client.chat.completions.create(**args).choices[0].message.content
    stop = pick_stop(ref)
    r = client.chat.completions.create(stop=[stop], **args)
    assert r.choices[0].message.content == ref[:ref.index(stop)]
    assert r.choices[0].finish_reason == "stop"


def test_stop_string_completion_stream(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, prompt=fresh("stop streaming"), max_tokens=64, **GREEDY, **NO_EOS)
    ref = client.completions.create(**args).choices[0].text
    stop = pick_stop(ref)
    text, finish = "", None
    for chunk in client.completions.create(stream=True, stop=stop, **args):
        for c in chunk.choices:
            text += c.text
            finish = c.finish_reason or finish
    assert text == ref[:ref.index(stop)]
    assert finish == "stop"


def test_stop_token_ids(client: openai.OpenAI, http: httpx.Client) -> None:
    args = dict(model=MODEL, messages=user(fresh("stop on a token")), max_tokens=64, logprobs=True,
                **GREEDY)
    ref = client.chat.completions.create(**args, **NO_EOS).choices[0]
    tokens = chat_tokens(ref.logprobs)
    # The first generated single ASCII byte token in the first half: its id through /tokenize.
    k = next(i for i, (b, _) in enumerate(tokens[:32]) if len(b) == 1 and b[0] < 0x80)
    ids = http.post("/tokenize", json={"prompt": tokens[k][0].decode(), "add_special_tokens": False}).json()
    assert len(ids["tokens"]) == 1
    k = next(i for i, (b, _) in enumerate(tokens) if b == tokens[k][0])  # its first occurrence
    r = client.chat.completions.create(**args, extra_body={"ignore_eos": True, "stop_token_ids": ids["tokens"]})
    c = r.choices[0]
    assert c.finish_reason == "stop"
    same_tokens(chat_tokens(c.logprobs), tokens[:k + 1])
    assert r.usage.completion_tokens == k + 1
    assert ref.message.content.startswith(c.message.content)


@pytest.mark.parametrize("max_tokens", [1, 7])
def test_max_tokens_length(client: openai.OpenAI, max_tokens: int) -> None:
    r = client.chat.completions.create(model=MODEL, messages=user(fresh("cut")), max_tokens=max_tokens,
                                       logprobs=True, **NO_EOS)
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == max_tokens == len(r.choices[0].logprobs.content)
    c = client.completions.create(model=MODEL, prompt=fresh("cut"), max_tokens=max_tokens, **NO_EOS)
    assert c.choices[0].finish_reason == "length" and c.usage.completion_tokens == max_tokens


def test_seed_reproducible(client: openai.OpenAI) -> None:
    messages = user(fresh("roll the dice"))

    def run(seed: int) -> tuple[str, list[tuple[bytes, float]]]:
        r = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=48, temperature=1.0,
                                           seed=seed, logprobs=True, **NO_EOS)
        return r.choices[0].message.content, chat_tokens(r.choices[0].logprobs)

    a, b, c = run(1234), run(1234), run(4321)
    assert a[0] == b[0]
    same_tokens(a[1], b[1])
    assert [t for t, _ in a[1]] != [t for t, _ in c[1]]


# ---- logprobs and echo --------------------------------------------------------------------------------------
def test_chat_top_logprobs(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=user(fresh("how sure")), max_tokens=16,
                                       logprobs=True, top_logprobs=3, **GREEDY, **NO_EOS)
    content = r.choices[0].logprobs.content
    assert len(content) == 16
    for t in content:
        assert t.logprob <= 0.0
        assert len(t.top_logprobs) == 3
        # Logprobs are the model's; input-only specials are never drawn, so only they may rank above the choice.
        assert all(t.logprob >= alt.logprob - 1e-5 for alt in t.top_logprobs if alt.token not in INPUT_ONLY_SPECIALS)
        assert bytes(t.bytes) in [bytes(alt.bytes) for alt in t.top_logprobs]
        alts = [alt.logprob for alt in t.top_logprobs]
        assert alts == sorted(alts, reverse=True)


def test_completion_logprobs(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt=fresh("legacy logprobs"), max_tokens=16, logprobs=2,
                                  **GREEDY, **NO_EOS)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 16
    two = 0
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert logprob <= 0.0 and 1 <= len(top) <= 2  # strings may collide (U+FFFD), so ≤ 2 keys
        two += len(top) == 2
        assert token in top
        assert logprob >= max(v for k, v in top.items() if k not in INPUT_ONLY_SPECIALS) - 1e-5  # as above
    assert two > 0
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_completion_echo_logprobs(client: openai.OpenAI) -> None:
    prompt = fresh("echo this prompt back")
    args = dict(model=MODEL, prompt=prompt, max_tokens=8, logprobs=1, **GREEDY, **NO_EOS)
    plain = client.completions.create(**args)
    r = client.completions.create(echo=True, **args)
    text = r.choices[0].text
    assert text == prompt + plain.choices[0].text
    lp = r.choices[0].logprobs
    n_prompt, n_gen = r.usage.prompt_tokens, r.usage.completion_tokens
    assert n_gen == 8 and n_prompt == plain.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n_prompt + n_gen
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(isinstance(x, float) and x <= 0.0 for x in lp.token_logprobs[1:])
    assert "".join(lp.tokens[1:n_prompt]) == prompt  # the prompt tokens come first, then the generated ones
    gen = list(zip(lp.tokens[n_prompt:], lp.token_logprobs[n_prompt:], strict=True))
    same_tokens(gen, list(zip(plain.choices[0].logprobs.tokens, plain.choices[0].logprobs.token_logprobs,
                              strict=True)))


def test_echo_prompt_logprobs_aligned(client: openai.OpenAI, http: httpx.Client) -> None:
    """The prompt logprob of token i is the distribution after tokens < i: for a prompt P + [x], entry
    len(P) must equal the first generated token's distribution of a run on P."""
    ids = http.post("/tokenize", json={"prompt": fresh("alignment check")}).json()["tokens"]
    on_p = client.completions.create(model=MODEL, prompt=ids, max_tokens=1, logprobs=3, **GREEDY, **NO_EOS)
    want = on_p.choices[0].logprobs.top_logprobs[0]
    x = http.post("/tokenize", json={"prompt": "x", "add_special_tokens": False}).json()["tokens"]
    r = client.completions.create(model=MODEL, prompt=ids + x, max_tokens=1, logprobs=3, echo=True, **GREEDY,
                                  **NO_EOS)
    got = r.choices[0].logprobs.top_logprobs[len(ids)]
    assert r.choices[0].logprobs.tokens[len(ids)] == "x"
    assert set(got) == set(want)
    for key, value in want.items():
        assert math.isclose(got[key], value, abs_tol=1e-3)


def test_token_id_and_list_prompts(client: openai.OpenAI, http: httpx.Client) -> None:
    a, b = fresh("first prompt"), fresh("second prompt, a little longer")
    args = dict(model=MODEL, max_tokens=10, **GREEDY, **NO_EOS)
    ref_a = client.completions.create(prompt=a, **args).choices[0].text
    ref_b = client.completions.create(prompt=b, **args).choices[0].text

    ids = http.post("/tokenize", json={"prompt": a}).json()["tokens"]
    by_ids = client.completions.create(prompt=ids, **args)
    assert by_ids.choices[0].text == ref_a and by_ids.usage.prompt_tokens == len(ids)
    echoed = client.completions.create(prompt=ids, echo=True, **args).choices[0].text
    assert echoed == a + ref_a

    both = client.completions.create(prompt=[a, b], **args)
    assert [(c.index, c.text) for c in both.choices] == [(0, ref_a), (1, ref_b)]
    assert both.usage.completion_tokens == 20
    ids_b = http.post("/tokenize", json={"prompt": b}).json()["tokens"]
    assert both.usage.prompt_tokens == len(ids) + len(ids_b)
    lists = client.completions.create(prompt=[ids, ids_b], **args)
    assert [c.text for c in lists.choices] == [ref_a, ref_b]


# ---- prefix cache -------------------------------------------------------------------------------------------
def long_prompt() -> str:
    text = fresh(" ".join(f"sentence {i} of a long shared document." for i in range(24)))
    assert len(text) > 700
    return text


def test_cached_tokens_on_repeat(client: openai.OpenAI, http: httpx.Client) -> None:
    hits_before = metric(http, "v4serve_prefix_cache_hits_total", source="device")
    args = dict(model=MODEL, messages=user(long_prompt()), max_tokens=16, **GREEDY, **NO_EOS)
    first = client.chat.completions.create(**args)
    second = client.chat.completions.create(**args)
    assert first.usage.prompt_tokens > 600
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens
    for r in (first, second):
        check_usage(r.usage.model_dump())
    assert second.choices[0].message.content == first.choices[0].message.content
    hits_after = metric(http, "v4serve_prefix_cache_hits_total", source="device")
    assert hits_after - hits_before >= cached


def test_reset_prefix_cache(client: openai.OpenAI, http: httpx.Client) -> None:
    args = dict(model=MODEL, prompt=long_prompt(), max_tokens=8, **GREEDY, **NO_EOS)
    first = client.completions.create(**args)
    assert client.completions.create(**args).usage.prompt_tokens_details.cached_tokens > 0
    r = http.post("/reset_prefix_cache")
    assert r.status_code == 200 and r.json()["status"] == "ok"
    after = client.completions.create(**args)
    assert after.usage.prompt_tokens_details.cached_tokens == 0
    assert after.usage.prompt_cache_miss_tokens == after.usage.prompt_tokens
    assert after.choices[0].text == first.choices[0].text


# ---- disconnects and concurrency ----------------------------------------------------------------------------
@pytest.fixture()
def lone_url() -> Iterator[str]:
    """A daemon of its own, so a request that is never aborted cannot slow the other tests down."""
    with daemon() as url:
        yield url


def test_stream_disconnect_frees_slot(lone_url: str) -> None:
    body = {"model": MODEL, "messages": user(fresh("never finish")), "max_tokens": 20000, "ignore_eos": True,
            "stream": True}
    with httpx.Client(base_url=lone_url, timeout=PATIENCE) as http:
        with http.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            seen = 0
            while seen < 4:
                seen += next(lines).startswith("data: ")
            assert metric(http, "v4serve_requests_running") == 1
            assert metric(http, "v4serve_state_cache_usage") > 0
        wait_for_metric(http, "v4serve_requests_running", 0)
        wait_for_metric(http, "v4serve_state_cache_usage", 0)
        assert metric(http, "v4serve_request_success_total", finished_reason="abort") == 1
        assert http.post("/v1/completions", json={"prompt": "still serving", "max_tokens": 2}).status_code == 200


def test_nonstream_disconnect_frees_slot(lone_url: str) -> None:
    body = {"model": MODEL, "prompt": fresh("never finish either"), "max_tokens": 20000, "ignore_eos": True}
    with httpx.Client(base_url=lone_url, timeout=PATIENCE) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.5))
        wait_for_metric(http, "v4serve_requests_running", 0)
        wait_for_metric(http, "v4serve_state_cache_usage", 0)


NEAR_TIE = 1e-3  # logprob margin below which batching's different rounding may flip a greedy choice


# chosen (token, bytes) per step, each step's top two tokens and their margin, finish reason
Stream = tuple[list[tuple[str, bytes]], list[tuple[str, str]], list[float], str | None]


def diverges_only_at_a_near_tie(solo: Stream, batched: Stream) -> bool:
    """Equal, or equal up to a step where the solo run's top two were within NEAR_TIE and the batched
    run took the solo run's second choice: a flip between two near-equal candidates, nothing else.
    Past it the two continuations are legitimately different texts."""
    (one, top2, margins, fa), (two, _, _, fb) = solo, batched
    if (one, fa) == (two, fb):
        return True
    first = next((i for i, (x, y) in enumerate(zip(one, two, strict=True)) if x != y), None)
    return first is not None and margins[first] < NEAR_TIE and two[first][0] == top2[first][1]


async def stream_once(c: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> Stream:
    chosen, top2, margins, finish = [], [], [], None
    stream = await c.chat.completions.create(model=MODEL, messages=user(prompt), max_tokens=max_tokens, stream=True,
                                             temperature=0.0, logprobs=True, top_logprobs=2,
                                             extra_body={"ignore_eos": True})
    async for chunk in stream:
        for ch in chunk.choices:
            for lp in (ch.logprobs.content or []) if ch.logprobs else []:
                chosen.append((lp.token, bytes(lp.bytes or [])))
                top = sorted(lp.top_logprobs, key=lambda t: t.logprob, reverse=True)
                top2.append((top[0].token, top[1].token))
                margins.append(top[0].logprob - top[1].logprob)
            finish = ch.finish_reason or finish
    return chosen, top2, margins, finish


def solo_then_together(base_url: str, prompts: list[str], max_tokens: int) -> tuple[list[Stream], ...]:
    """Each prompt alone; then all at once on a cold cache (prefills, chunked where long, beside
    decodes); then all at once again, every prompt a prefix-cache hit."""

    async def run(together: bool) -> list[Stream]:
        async with openai.AsyncOpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0,
                                      timeout=PATIENCE) as c:
            if together:
                return list(await asyncio.gather(*(stream_once(c, p, max_tokens) for p in prompts)))
            return [await stream_once(c, p, max_tokens) for p in prompts]

    solo = asyncio.run(run(together=False))
    assert httpx.post(base_url + "/reset_prefix_cache", timeout=PATIENCE).status_code == 200
    return solo, asyncio.run(run(together=True)), asyncio.run(run(together=True))


def test_concurrent_streams_match_solo_up_to_a_near_tie(base_url: str, http: httpx.Client) -> None:
    """The default mode batches rows, so a request's logits move by fp32 rounding with its batch-mates:
    only a flip between two near-equal candidates may differ. Prompt and reply stay under the
    indexer's top-k (16 entries of 4 tokens): every query attends every entry, so rounding cannot
    change which entries are read (that would move logits by more than rounding; --batch-invariant's
    bitwise test covers long prompts)."""
    prompts = [f"{uuid.uuid4().hex[:8]} " + "x" * i for i in range(16)]  # ≤ 30 tokens with the template
    solo, cold, warm = solo_then_together(base_url, prompts, max_tokens=24)
    assert all(f == "length" and len(chosen) == 24 for chosen, _, _, f in solo)
    exact = 0
    for name, batch in (("cold", cold), ("warm", warm)):
        for i, (a, b) in enumerate(zip(solo, batch, strict=True)):
            assert diverges_only_at_a_near_tie(a, b), f"prompt {i} differs when batched ({name} cache)"
            exact += a[0] == b[0]
    assert exact >= 28, "near-ties are rare: most batched runs must equal their solo run exactly"
    wait_for_metric(http, "v4serve_requests_running", 0)


def test_the_near_tie_allowance_only_covers_near_ties() -> None:
    a, b, c, x, y, z = ((t, t.encode()) for t in "abcxyz")
    top2 = [("a", "q"), ("b", "x"), ("c", "z")]
    solo = ([a, b, c], top2, [0.5, 2e-4, 0.7], "length")
    assert diverges_only_at_a_near_tie(solo, solo)
    assert diverges_only_at_a_near_tie(solo, ([a, x, y], [], [], "length"))  # the near-tied runner-up
    assert not diverges_only_at_a_near_tie(solo, ([a, y, c], [], [], "length"))  # a near tie, another token
    assert not diverges_only_at_a_near_tie(solo, ([x, b, c], [], [], "length"))  # no near tie
    assert not diverges_only_at_a_near_tie(solo, ([a, b, z], [], [], "length"))


# ---- small endpoints ----------------------------------------------------------------------------------------
def test_models_health_version(client: openai.OpenAI, http: httpx.Client) -> None:
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL, *ALIASES]
    assert models[0].object == "model" and isinstance(models[0].owned_by, str)
    assert http.get("/health").json() == {"status": "ok"}
    info = http.get("/version").json()
    assert isinstance(info["version"], str) and re.match(r"^\d+\.\d+", info["version"])
    assert info["device"] == "cpu" and info["dtype"] == "float32" and info["kv_cache_dtype"] == "float32"
    assert info["attention_backend"] == "torch"  # auto on a CPU
    assert http.get("/metrics").headers["content-type"].startswith("text/plain")


def test_tokenize_detokenize_round_trip(http: httpx.Client) -> None:
    text = "Grüße, 世界! 🙂 tabs\tand\nnewlines"
    raw = http.post("/tokenize", json={"prompt": text, "add_special_tokens": False}).json()
    assert raw["count"] == len(raw["tokens"]) == len(text.encode())
    assert http.post("/detokenize", json={"tokens": raw["tokens"]}).json()["prompt"] == text
    with_bos = http.post("/tokenize", json={"prompt": text}).json()["tokens"]
    assert with_bos[1:] == raw["tokens"] and len(with_bos) == len(raw["tokens"]) + 1
    chat = http.post("/tokenize", json={"messages": user(text)}).json()
    assert chat["count"] == len(chat["tokens"]) > len(with_bos)
    assert text in http.post("/detokenize", json={"tokens": chat["tokens"]}).json()["prompt"]
    limit = http.get("/v1/models").json()["data"][0]["max_model_len"]
    assert raw["max_model_len"] == limit


def test_thinking_mode(client: openai.OpenAI) -> None:
    args = dict(model=MODEL, messages=user(fresh("think first")), max_tokens=24, temperature=0.0,
                extra_body={"thinking": True, "ignore_eos": True})
    message = client.chat.completions.create(**args).choices[0].message.model_dump()
    assert isinstance(message["reasoning_content"], str) and isinstance(message["content"], str)
    assert message["reasoning_content"] or message["content"]
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            delta = c.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content) == (message["reasoning_content"], message["content"])
    plain = client.chat.completions.create(model=MODEL, messages=args["messages"], max_tokens=4, **GREEDY)
    assert plain.choices[0].message.model_dump().get("reasoning_content") is None



# DESIGN.md's metric contract: (name, labels that must appear on some series of it).
DESIGN_METRICS = [
    ("v4serve_prefix_cache_queries_total", {}), ("v4serve_prefix_cache_hits_total", {"source": "device"}),
    ("v4serve_prefix_cache_hits_total", {"source": "disk"}), ("v4serve_swa_recompute_tokens_total", {}),
    ("v4serve_state_cache_usage", {}), ("v4serve_block_cache_usage", {}), ("v4serve_kv_store_read_bytes_total", {}),
    ("v4serve_kv_store_written_bytes_total", {}), ("v4serve_kv_store_read_seconds_bucket", {}),
    ("v4serve_kv_store_usage_bytes", {}), ("v4serve_kv_store_errors_total", {"kind": "checksum"}),
    ("v4serve_time_to_first_token_seconds_bucket", {}), ("v4serve_inter_token_latency_seconds_bucket", {}),
    ("v4serve_e2e_request_latency_seconds_bucket", {}), ("v4serve_requests_running", {}),
    ("v4serve_requests_waiting", {}), ("v4serve_prompt_tokens_total", {}), ("v4serve_generation_tokens_total", {}),
]


def test_metrics_expose_every_contract_name(http: httpx.Client) -> None:
    series = []
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            series.append((name, dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))))
    missing = [(name, want) for name, want in DESIGN_METRICS
               if not any(n == name and want.items() <= labels.items() for n, labels in series)]
    assert not missing, missing


def scrape(http: httpx.Client) -> dict[tuple[str, frozenset], float]:
    """One /metrics reading: {(series name, its labels): value}."""
    found = {}
    for line in http.get("/metrics").text.splitlines():
        if line and not line.startswith("#"):
            series, value = line.rsplit(" ", 1)
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', series))
            found[(series.split("{")[0], labels)] = float(value)
    return found


def test_vllm_metric_names_carry_the_same_values(http: httpx.Client) -> None:
    """What routers and the Gateway API Inference Extension read, under vLLM's names, from the same
    snapshot as v4serve's own (one scrape)."""
    body = {"model": MODEL, "prompt": "a prompt for the router metrics " * 20, "max_tokens": 2}
    for _ in range(2):  # the second is a prefix hit
        assert http.post("/v1/completions", json=body).status_code == 200
    got = scrape(http)

    def one(name: str, **labels: str) -> float:
        return sum(v for (n, ls), v in got.items() if n == name and set(labels.items()) <= ls)

    pairs = [("vllm:num_requests_running", "v4serve_requests_running"),
             ("vllm:num_requests_waiting", "v4serve_requests_waiting"),
             ("vllm:kv_cache_usage_perc", "v4serve_block_cache_usage"),
             ("vllm:gpu_cache_usage_perc", "v4serve_block_cache_usage"),
             ("vllm:prefix_cache_queries_total", "v4serve_prefix_cache_queries_total"),
             ("vllm:prefix_cache_hits_total", "v4serve_prefix_cache_hits_total"),
             ("vllm:num_preemptions_total", "v4serve_num_preemptions_total")]
    for vllm_name, ours in pairs:
        assert (vllm_name, frozenset({("model_name", MODEL), ("engine", "0")})) in got, vllm_name
        assert one(vllm_name) == one(ours), (vllm_name, ours)
    assert one("vllm:prefix_cache_hits_total") >= 128  # the second request hit at least a block
    info = next(dict(ls) for (n, ls) in got if n == "vllm:cache_config_info")
    assert info == {"block_size": "128", "num_gpu_blocks": info["num_gpu_blocks"], "enable_prefix_caching": "True"}
    assert int(info["num_gpu_blocks"]) > 0
    assert next(dict(ls) for (n, ls) in got if n == "vllm:lora_requests_info")["running_lora_adapters"] == ""


def test_a_request_picks_its_own_swa_cache_mode_on_every_endpoint(http: httpx.Client) -> None:
    """`swa_cache_mode` (full/periodic/zero/auto) on chat, completions, Responses and Messages: counted
    by how the request wrote snapshots; anything else is a 400 naming the field."""
    def written(mode: str) -> float:
        return metric(http, "v4serve_swa_requests_total", mode=mode)

    before = {mode: written(mode) for mode in ("full", "zero", "periodic")}
    text = fresh("a document " * 40)
    bodies = {"/v1/completions": {"model": MODEL, "prompt": text, "max_tokens": 2},
              "/v1/chat/completions": {"model": MODEL, "messages": user(text), "max_tokens": 2},
              "/v1/responses": {"model": MODEL, "input": text, "max_output_tokens": 2},
              "/v1/messages": {"model": MODEL, "messages": user(text), "max_tokens": 2}}
    for path, body in bodies.items():
        assert http.post(path, json={**body, "swa_cache_mode": "zero"}).status_code == 200, path
        bad = http.post(path, json={**body, "swa_cache_mode": "sometimes"})
        assert bad.status_code == 400 and "swa_cache_mode" in bad.text, (path, bad.text)
    assert http.post("/v1/completions", json={**bodies["/v1/completions"], "prompt": fresh("x" * 300),
                                              "swa_cache_mode": "full"}).status_code == 200
    assert written("zero") - before["zero"] == 4 and written("full") - before["full"] == 1
    assert written("periodic") == before["periodic"]  # the daemon's own mode wrote nothing of these
    assert metric(http, "v4serve_swa_snapshot_bytes_total", tier="host") > 0
    assert "v4serve_swa_hot_prefixes{" in http.get("/metrics").text


def test_deepseeks_thinking_switch_and_every_reasoning_effort(http: httpx.Client) -> None:
    """DeepSeek's `{"type": "enabled"|"disabled"}` is the boolean switch; efforts map as DeepSeek's converter
    maps them: none given is high (its instruction), minimal and low think with none, medium and xhigh are
    high, max has its own (longer) instruction; an effort without a switch turns thinking on, `none` off."""
    def reply(**fields: Any) -> tuple[int, str]:
        body = {"model": MODEL, "messages": user("a question to think about"), "max_tokens": 6, "temperature": 0,
                "ignore_eos": True, **fields}
        got = http.post("/v1/chat/completions", json=body)
        assert got.status_code == 200, got.text
        message = got.json()["choices"][0]["message"]
        return got.json()["usage"]["prompt_tokens"], (message.get("reasoning_content") or "") + message["content"]

    assert reply(thinking={"type": "enabled"}) == reply(thinking=True) != reply(thinking=False)
    assert reply(thinking={"type": "disabled"}) == reply(thinking=False) == reply()  # the tiny model: chat mode
    high, low = reply(thinking=True, reasoning_effort="high"), reply(thinking=True, reasoning_effort="low")
    assert reply(thinking=True) == high and high[0] > low[0]  # the high instruction
    assert reply(thinking=True, reasoning_effort="max")[0] > high[0]  # the max one, longer
    for effort in ("medium", "xhigh"):
        assert reply(thinking=True, reasoning_effort=effort) == high
    assert reply(thinking=True, reasoning_effort="minimal") == low
    assert reply(thinking=True, reasoning_effort="none") == high  # the switch wins
    assert reply(reasoning_effort="high") == high and reply(reasoning_effort="none") == reply(thinking=False)
    for bad in ({"reasoning_effort": "turbo"}, {"thinking": {"type": "on"}}):
        got = http.post("/v1/chat/completions", json={"model": MODEL, "messages": user("x"), **bad})
        assert got.status_code == 400 and got.json()["error"]["param"].split(".")[0] == next(iter(bad)), got.text


def test_deepseeks_base_url_and_model_names(http: httpx.Client) -> None:
    """Every route also answers without `/v1` (DeepSeek's documented base URL); each served name is a
    model of its own in /v1/models (created when the daemon started, with its context length), and a
    reply carries the name it was asked for."""
    listed = http.get("/models").json()["data"]
    assert listed == http.get("/v1/models").json()["data"]
    assert [m["id"] for m in listed] == [MODEL, *ALIASES]
    assert {m["created"] for m in listed} == {listed[0]["created"]} and 0 < time.time() - listed[0]["created"] < 3600
    assert all(m["context_length"] == m["max_model_len"] > 0 and m["root"] == MODEL for m in listed)
    assert http.get("/models/deepseek-reasoner").json() == listed[2]
    body = {"messages": user("which model?"), "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    replies = {name: http.post("/chat/completions", json={**body, "model": name}).json() for name in ALIASES}
    assert {name: r["model"] for name, r in replies.items()} == {name: name for name in ALIASES}
    assert len({r["choices"][0]["message"]["content"] for r in replies.values()}) == 1  # one model
    completion = http.post("/completions", json={"model": "deepseek-chat", "prompt": "x", "max_tokens": 2})
    assert completion.status_code == 200 and completion.json()["model"] == "deepseek-chat"
    assert http.post("/v1/chat/completions", json={**body}).json()["model"] == MODEL  # no name: the first
    missing = http.post("/chat/completions", json={**body, "model": "deepseek-v4-flash"})
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_reasoning_tokens_in_usage(http: httpx.Client) -> None:
    """`completion_tokens_details.reasoning_tokens`: the thinking tokens, `</think>` included."""
    think_end = http.post("/tokenize", json={"prompt": "</think>", "add_special_tokens": False}).json()["tokens"]
    assert len(think_end) == 1

    def usage(thinking: bool, bias: float, stream: bool = False) -> dict[str, Any]:
        body = {"model": MODEL, "messages": user("think"), "max_tokens": 5, "temperature": 0, "ignore_eos": True,
                "thinking": thinking, "logit_bias": {str(think_end[0]): bias}}
        if stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
            with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                return json.loads(sse_events(resp)[-2])["usage"]
        return http.post("/v1/chat/completions", json=body).json()["usage"]

    assert usage(True, 100)["completion_tokens_details"] == {"reasoning_tokens": 1}  # ends its thinking at once
    assert usage(True, -100)["completion_tokens_details"] == {"reasoning_tokens": 5}  # thinks throughout
    assert usage(True, -100, stream=True)["completion_tokens_details"] == {"reasoning_tokens": 5}
    assert usage(False, 0)["completion_tokens_details"] == {"reasoning_tokens": 0}
