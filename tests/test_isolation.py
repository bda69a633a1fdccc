"""No request can hurt another. Inputs that once killed the engine loop, a generated sweep over the
sampling parameters at their extremes, faults injected into one request's sampling or text, body
limits, parsing off the event loop, and a graceful SIGTERM: every response is a 200 or an OpenAI
error, and a stream running alongside ends with exactly its solo output."""

from __future__ import annotations

import json
import math
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.daemon import PATIENCE, daemon, in_process_server, start_daemon, wait_until
from v4serve.server.protocol import CompletionRequest
from v4serve.server.serve import ServeConfig
from v4serve.server.text.output import ChoiceText

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
STEADY = {"prompt": "a stream that must not notice anything", "max_tokens": 120, "temperature": 0,
          "ignore_eos": True}


@pytest.fixture(scope="module")
def http(base_url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=base_url, timeout=PATIENCE) as c:
        yield c


def stream_text(url: str, body: dict[str, Any], path: str = COMPLETIONS) -> tuple[str, list[str]]:
    """(concatenated text, the raw `data:` payloads) of a streamed request."""
    with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=PATIENCE) as resp:
        assert resp.status_code == 200, resp.read()
        events = [line[6:] for line in resp.iter_lines() if line.startswith("data: ")]
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    text = "".join(c["choices"][0].get("text") or "" for c in chunks if c.get("choices"))
    return text, events


class Alongside(threading.Thread):
    """A greedy stream running while something else happens."""

    def __init__(self, url: str, body: dict[str, Any] = STEADY) -> None:
        super().__init__(daemon=True)
        self.url, self.body, self.text, self.events = url, body, "", []

    def run(self) -> None:
        self.text, self.events = stream_text(self.url, self.body)

    def result(self) -> str:
        self.join(timeout=PATIENCE)
        assert self.events and self.events[-1] == "[DONE]"
        return self.text


def assert_openai_error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


# ---- inputs that once stopped the engine for everyone --------------------------------------------
ENGINE_KILLERS: dict[str, dict[str, Any]] = {
    "top_p that is 0 in float32": {"top_p": 1e-46, "temperature": 1.0},
    "repetition_penalty 1e-300": {"repetition_penalty": 1e-300},
    "seed 2**64": {"seed": 2**64},
    "seed that overflows with the choice index": {"seed": 2**63 - 1, "n": 2, "temperature": 1.0},
    "negative seed": {"seed": -1},
    "denormal temperature": {"temperature": 5e-324},
    "denormal min_p": {"min_p": 5e-324, "temperature": 1.0},
    "top_k past any int64": {"top_k": 2**70, "temperature": 1.0},
    "logit_bias id past any int64": {"logit_bias": {str(2**70): 1.0}},
    "a 100 KB stop string": {"stop": ["x" * 100_000]},
    "max_tokens past any int64": {"max_tokens": 2**70},
}
RAW_BODIES: dict[str, tuple[str, bytes]] = {
    "lone surrogate in a prompt": (COMPLETIONS, b'{"prompt": "a\\ud800b", "max_tokens": 2}'),
    "lone surrogate in a message": (CHAT, b'{"messages": [{"role": "user", "content": "\\udfff"}], "max_tokens": 2}'),
    "invalid UTF-8": (COMPLETIONS, b'{"prompt": "a\xff\xfeb", "max_tokens": 2}'),
    "NaN temperature": (COMPLETIONS, b'{"prompt": "a", "max_tokens": 2, "temperature": NaN}'),
    "Infinity top_p": (COMPLETIONS, b'{"prompt": "a", "max_tokens": 2, "top_p": Infinity}'),
}


def test_engine_killers_are_answered_and_hurt_nobody(base_url: str, http: httpx.Client) -> None:
    solo = stream_text(base_url, STEADY)[0]
    alongside = Alongside(base_url)
    alongside.start()
    for name, fields in ENGINE_KILLERS.items():
        resp = http.post(COMPLETIONS, json={"prompt": "killer", "max_tokens": 3, **fields})
        assert resp.status_code in (200, 400), (name, resp.text)
        if resp.status_code == 400:
            assert_openai_error(resp, 400)
    for name, (path, raw) in RAW_BODIES.items():
        resp = http.post(path, content=raw, headers={"content-type": "application/json"})
        message = assert_openai_error(resp, 400)["message"]
        assert "not valid JSON" in message if "UTF" in name or "surrogate" in name else message, name
    assert alongside.result() == solo
    assert http.get("/health").status_code == 200


def test_tiny_top_p_and_temperature_sample_the_likeliest_token(http: httpx.Client) -> None:
    """Values that round to 0 in float32 behave as their limit: keep the top token, or greedy."""
    greedy = http.post(COMPLETIONS, json={"prompt": "limits", "max_tokens": 6, "temperature": 0}).json()
    for fields in ({"top_p": 1e-46, "temperature": 1.0}, {"temperature": 5e-324}):
        got = http.post(COMPLETIONS, json={"prompt": "limits", "max_tokens": 6, **fields}).json()
        assert got["choices"][0]["text"] == greedy["choices"][0]["text"], fields


EXTREMES = st.sampled_from([0, 0.0, -0.0, 5e-324, 1e-310, 1e-46, 1e-7, 0.5, 1, 2, 10, 1e308, -1e308, 2**63 - 1,
                            2**63, 2**64, -(2**64), math.nan, math.inf, -math.inf])
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                   "repetition_penalty", "seed")
SWEEP = st.fixed_dictionaries(
    {"max_tokens": st.sampled_from([0, 1, 3, -1, 2**64, 1e308, math.nan])},
    optional={**{name: EXTREMES for name in SAMPLING_FIELDS},
              "n": st.sampled_from([0, 1, 2, 17, 2**64]),
              "logit_bias": st.dictionaries(st.sampled_from(["0", "65", "319", "320", "-1", str(2**64)]), EXTREMES,
                                            max_size=3)})


def test_sweep_of_extreme_sampling_parameters(base_url: str, http: httpx.Client) -> None:
    solo = stream_text(base_url, STEADY)[0]
    alongside = Alongside(base_url)
    alongside.start()

    @settings(max_examples=120, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(fields=SWEEP, chat=st.booleans())
    def one(fields: dict[str, Any], chat: bool) -> None:
        body = {"messages": [{"role": "user", "content": "sweep"}]} if chat else {"prompt": "sweep"}
        raw = json.dumps({**body, **fields}).encode()  # NaN and Infinity go out as JSON cannot carry them
        resp = http.post(CHAT if chat else COMPLETIONS, content=raw, headers={"content-type": "application/json"})
        assert resp.status_code in (200, 400), (fields, resp.text)
        if resp.status_code == 400:
            assert_openai_error(resp, 400)

    one()
    assert alongside.result() == solo
    assert http.get("/health").status_code == 200


# ---- faults injected into one request ------------------------------------------------------------------
def test_a_sampling_fault_fails_only_its_request() -> None:
    cfg = ServeConfig(no_kv_store=True, engine_hook="tests.faults:fail_sampling_with_seed_4242")
    with in_process_server(cfg) as (url, engine):
        solo = stream_text(url, STEADY)[0]
        alongside = Alongside(url)
        alongside.start()
        bad = {"prompt": "doomed", "max_tokens": 5, "seed": 4242}
        err = assert_openai_error(httpx.post(url + COMPLETIONS, json=bad, timeout=PATIENCE), 500)
        # The fault's kind, never its text: that stays in the engine's log.
        assert "sampling failed (RuntimeError" in err["message"] and err["code"] == "generation_failed"
        assert "injected sampling fault" not in err["message"]
        _, events = stream_text(url, bad)
        assert events[-1] == "[DONE]" and "sampling failed (RuntimeError" in json.loads(events[-2])["error"]["message"]
        assert not any("injected sampling fault" in e for e in events)
        assert alongside.result() == solo
        assert httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
        assert engine.stats.running == 0


def test_a_text_fault_fails_only_its_choice(monkeypatch: pytest.MonkeyPatch) -> None:
    real = ChoiceText.push

    def push(self, out):  # noqa: ANN001, ANN202
        if self.options.stop == ("FAILME",):
            raise UnicodeError("injected detokenizer fault")
        return real(self, out)

    monkeypatch.setattr(ChoiceText, "push", push)
    with in_process_server(ServeConfig(no_kv_store=True)) as (url, engine):
        solo = stream_text(url, STEADY)[0]
        alongside = Alongside(url)
        alongside.start()
        bad = {"prompt": "doomed", "max_tokens": 50, "ignore_eos": True, "stop": ["FAILME"]}
        err = assert_openai_error(httpx.post(url + COMPLETIONS, json=bad, timeout=PATIENCE), 500)
        assert err["message"].startswith("detokenizing failed: internal error (err_")
        assert "injected detokenizer fault" not in err["message"]
        assert alongside.result() == solo
        # The failed request was stopped in the engine too (its stats reach this process a step later).
        wait_until(lambda: engine.stats.running == 0, "the failed request to stop in the engine")


# ---- limits --------------------------------------------------------------------------------------------
def test_request_body_limit() -> None:
    with daemon("--max-request-bytes", "65536") as url:
        big = json.dumps({"prompt": "a" * 70_000, "max_tokens": 1}).encode()
        declared = httpx.post(url + COMPLETIONS, content=big, headers={"content-type": "application/json"},
                              timeout=PATIENCE)
        assert assert_openai_error(declared, 413)["code"] == "request_too_large"

        def chunked() -> Iterator[bytes]:  # no Content-Length: counted while it arrives
            for i in range(0, len(big), 8192):
                yield big[i:i + 8192]

        streamed = httpx.post(url + COMPLETIONS, content=chunked(), headers={"content-type": "application/json"},
                              timeout=PATIENCE)
        assert assert_openai_error(streamed, 413)["code"] == "request_too_large"
        fits = httpx.post(url + COMPLETIONS, json={"prompt": "a" * 60_000, "max_tokens": 1}, timeout=PATIENCE)
        assert fits.status_code == 400  # parsed fine; longer than the model's context


def test_health_answers_while_a_large_body_is_parsed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Bodies are parsed off the event loop: a /health probe is answered while a large body's parse
    is under way. The parse (of the real 3.5 MB body) is held until the probe's answer has come, so
    parsed on the loop neither could go on and the probe would time out. The order proves it, where
    a latency bound would also fail a loop that is merely slow on a busy machine."""
    real = CompletionRequest.model_validate_json
    parsing, answered = threading.Event(), threading.Event()

    def validate(data, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202 - pydantic's signature
        if len(data) > 1 << 20:  # the large body only
            parsing.set()
            assert answered.wait(PATIENCE), "no /health answer came while the body was being parsed"
        return real(data, *args, **kwargs)

    monkeypatch.setattr(CompletionRequest, "model_validate_json", validate)
    ids = [64 + i % 256 for i in range(550_000)]  # ~3.5 MB of token ids, under the 4 MiB default
    body = json.dumps({"prompt": ids, "max_tokens": 1}).encode()
    with in_process_server(ServeConfig(no_kv_store=True)) as (url, _), ThreadPoolExecutor(1) as pool:
        posted = pool.submit(httpx.post, url + COMPLETIONS, content=body, headers={"content-type": "application/json"},
                             timeout=PATIENCE)
        assert parsing.wait(PATIENCE), "the large body never reached its parse"
        try:
            health = httpx.get(url + "/health", timeout=PATIENCE)
        finally:
            answered.set()
        refused = posted.result()
    assert health.status_code == 200
    assert_openai_error(refused, 400)  # longer than the context: refused after parsing


# ---- graceful shutdown ----------------------------------------------------------------------------------
def test_sigterm_lets_streams_end_with_done_and_exits_cleanly(tmp_path) -> None:
    """8 streams at SIGTERM: the 4 short ones finish within --shutdown-timeout, the 4 endless ones
    are ended then with an error event; all end with [DONE]; exit 0; no temp files left."""
    timeout = 8
    running = start_daemon("--shutdown-timeout", str(timeout), "--kv-store-dir", str(tmp_path))
    results: list[list[str]] = [[] for _ in range(8)]
    started = threading.Barrier(9, timeout=PATIENCE)

    def stream(i: int) -> None:
        body = {"prompt": f"stream {i} " * 40, "max_tokens": 20000 if i % 2 else 30, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", running.url + COMPLETIONS, json=body, timeout=PATIENCE) as resp:
            lines = resp.iter_lines()
            results[i].append(next(line for line in lines if line.startswith("data: ")))
            started.wait()
            results[i] += [line for line in lines if line.startswith("data: ")]

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    code = running.stop(signal.SIGTERM)
    elapsed = time.monotonic() - t0
    for t in threads:
        t.join(timeout=PATIENCE)
    # The endless streams hold the daemon for the whole --shutdown-timeout. No upper bound: how long
    # ending them and exiting takes is the machine's business; a daemon that never exits is killed by
    # stop() after PATIENCE and fails on its exit code, and one whose streams uvicorn cut off (its
    # own limit is --shutdown-timeout + 5 s) fails on their last events below.
    assert code == 0 and elapsed >= timeout
    for i, lines in enumerate(results):
        assert lines[-1] == "data: [DONE]"
        last = json.loads(lines[-2][6:])
        if i % 2:  # 20000 tokens cannot finish in time: ended, with an event saying why
            assert "shutting down" in last["error"]["message"]
        else:
            assert last["choices"][0]["finish_reason"] == "length"
    assert not list(tmp_path.rglob(".tmp-*"))


# ---- tenants ------------------------------------------------------------------------------------------------
def test_cache_salt_separates_tenants(http: httpx.Client) -> None:
    prompt = {"prompt": "a long shared system prompt for every tenant " * 8, "max_tokens": 1}

    def cached(salt: str) -> int:
        reply = http.post(COMPLETIONS, json={**prompt, "cache_salt": salt}).json()
        return reply["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0  # the same tenant hits its own prefix
    assert cached("tenant-b") == 0  # another tenant's identical prompt shares nothing
