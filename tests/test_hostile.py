"""Hostile clients against one real daemon (the tiny model): requests that are valid on the wire but
malformed in meaning, or meant to break out of what the server builds from them, get a clear 4xx in
OpenAI's error shape, and the daemon keeps serving everyone else the same tokens."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import llguidance
import pytest

from tests.daemon import PATIENCE, Daemon, start_daemon, wait_until
from v4serve.server.text.tokenizer import ByteTokenizer
from v4serve.server.tools import _regex_body

MODEL = "v4serve-tiny"
ALLOWED = "https://app.example.com"
MAX_CONNECTIONS = 40
MAX_LOGPROB_ENTRIES = 1500
GREEDY = {"model": MODEL, "prompt": "The quick brown fox", "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def running() -> Iterator[Daemon]:
    served = start_daemon("--api-key", "sk-hostile", "--allowed-origins", ALLOWED, "--header-timeout", "2",
                          "--keep-alive-timeout", "2", "--max-connections", str(MAX_CONNECTIONS),
                          "--max-logprob-entries", str(MAX_LOGPROB_ENTRIES))
    try:
        yield served
    finally:
        served.stop()


@pytest.fixture(scope="module")
def url(running: Daemon) -> str:
    return running.url


@pytest.fixture(scope="module")
def http(url: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=url, timeout=PATIENCE, headers={"Authorization": "Bearer sk-hostile"}) as client:
        yield client


@pytest.fixture(scope="module")
def greedy_text(http: httpx.Client) -> str:
    """The greedy request's text, served alone before any hostile request."""
    return completion_text(http)


def completion_text(http: httpx.Client) -> str:
    response = http.post("/v1/completions", json=GREEDY)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def assert_refused(response: httpx.Response, status: int, param: str | None, says: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    assert says in error["message"], error["message"]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 40,
            "temperature": 0, **fields}


# ---- logit_bias keys -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("key", ["²", "١٢", "1.5", "", "0x10"])
def test_logit_bias_keys_that_are_not_ascii_token_ids_are_a_400(http: httpx.Client, greedy_text: str,
                                                                key: str) -> None:
    """`"²".isdigit()` is true but `int("²")` raises: the key once passed validation and failed later (a 500)."""
    response = http.post("/v1/completions", json={**GREEDY, "logit_bias": {key: 5}})
    assert_refused(response, 400, "logit_bias", "logit_bias keys must be token ids")
    assert completion_text(http) == greedy_text


# ---- schemas the grammar engine cannot finish --------------------------------------------------------------------
def json_schema(schema: dict[str, Any]) -> dict[str, Any]:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema}}


def test_a_schema_that_is_only_itself_is_a_400_before_any_work(http: httpx.Client, greedy_text: str) -> None:
    """`{"$ref": "#"}` compiles but allows no first token: found when the request is checked."""
    response = http.post("/v1/chat/completions", json=chat(response_format=json_schema({"$ref": "#"})))
    assert_refused(response, 400, "response_format", "the grammar engine cannot continue after 0 tokens")
    assert completion_text(http) == greedy_text


# An object that must contain itself has no finite value: the grammar engine gives up after the first token.
ENDLESS = {"type": "object", "properties": {"a": {"$ref": "#"}}, "required": ["a"]}


def test_a_schema_the_grammar_engine_gives_up_on_midway_is_a_400_not_a_500(http: httpx.Client,
                                                                          greedy_text: str) -> None:
    response = http.post("/v1/chat/completions", json=chat(response_format=json_schema(ENDLESS)))
    assert_refused(response, 400, "response_format", "the grammar engine cannot continue")
    assert completion_text(http) == greedy_text


def test_streamed_the_same_failure_is_an_invalid_request_error_event(http: httpx.Client) -> None:
    with http.stream("POST", "/v1/chat/completions", json=chat(response_format=json_schema(ENDLESS),
                                                               stream=True)) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(e)["error"] for e in events[:-1] if "error" in json.loads(e)]
    assert events[-1] == "[DONE]"
    assert [(e["type"], e["param"]) for e in errors] == [("invalid_request_error", "response_format")]
    assert "the grammar engine cannot continue" in errors[0]["message"]


# ---- tool parameter patterns ---------------------------------------------------------------------------------------
def pattern_matcher(pattern: str) -> llguidance.LLMatcher:
    """A Lark grammar whose only rule is `pattern` as the tool grammar writes it, on the byte vocabulary."""
    tokenizer = ByteTokenizer()
    lltok = llguidance.LLTokenizer(tokenizer.vocabulary_json(), n_vocab=tokenizer.vocab_size,
                                   eos_token=tokenizer.eos_token_id)
    grammar = llguidance.LLMatcher.grammar_from_lark(f"start: /{_regex_body(pattern)}/")
    return llguidance.LLMatcher(lltok, grammar, log_level=0)


def accepts(pattern: str, text: str) -> bool:
    matcher = pattern_matcher(pattern)
    assert not matcher.is_error(), matcher.get_error()
    tokens = ByteTokenizer().encode(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


# Each pattern with strings Python's `re` matches in full and strings it does not: the grammar must agree.
PATTERNS = {
    r"a\/b": (["a/b"], ["a\\/b", "ab"]),  # an escaped slash: the old escaping closed the literal after `\\`
    r"a\\/b": (["a\\/b"], ["a/b"]),  # an escaped backslash, then a slash
    "x\ny": (["x\ny"], ["xy"]),  # a raw line break: the old escaping ended the rule there
    r"[/]+": (["/", "//"], [""]),
    r"[0-9]\/ | \/(?s:.*)": (["1/ ", " /anything"], ["12"]),
}


@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_a_pattern_constrains_its_value_exactly_as_pythons_re(pattern: str) -> None:
    matching, other = PATTERNS[pattern]
    for text in matching:
        assert re.fullmatch(pattern, text) and accepts(pattern, text), text
    for text in other:
        assert not re.fullmatch(pattern, text) and not accepts(pattern, text), text


def forced_tool(pattern: str) -> dict[str, Any]:
    parameters = {"type": "object", "properties": {"code": {"type": "string", "pattern": pattern}},
                  "required": ["code"]}
    return chat(tools=[{"type": "function", "function": {"name": "lookup", "parameters": parameters}}],
                tool_choice={"type": "function", "function": {"name": "lookup"}}, max_tokens=300)


@pytest.mark.parametrize("pattern", ["[0-9]+\\", "(ab", "a{2,1}"])
def test_an_invalid_pattern_is_a_400(http: httpx.Client, greedy_text: str, pattern: str) -> None:
    """JSON Schema's own check of the tool's schema finds it (its `pattern` must be a regex)."""
    response = http.post("/v1/chat/completions", json=forced_tool(pattern))
    assert_refused(response, 400, "tools[0].function.parameters", "is not a valid JSON schema")
    assert repr(pattern)[1:-1] in response.json()["error"]["message"] or pattern in response.json()["error"]["message"]
    assert completion_text(http) == greedy_text


def test_a_pattern_written_to_inject_rules_only_constrains_its_value(http: httpx.Client) -> None:
    """The pattern is one regex: it neither ends the literal nor adds rules, and the forced call's
    value matches it."""
    pattern = '[0-9]{2}\\/\nstart: "pwned"'
    response = http.post("/v1/chat/completions", json=forced_tool(pattern))
    assert response.status_code == 200, response.text
    call = response.json()["choices"][0]["message"]["tool_calls"][0]["function"]
    assert re.fullmatch(pattern, json.loads(call["arguments"])["code"])


# ---- the API key's scheme ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("header", ["bearer sk-hostile", "BEARER sk-hostile", "Bearer  sk-hostile"])
def test_the_bearer_scheme_is_case_insensitive(url: str, header: str) -> None:
    response = httpx.post(url + "/v1/completions", json=GREEDY, headers={"Authorization": header}, timeout=PATIENCE)
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("header", ["Basic sk-hostile", "Bearer sk-other", "sk-hostile", "Bearersk-hostile"])
def test_other_credentials_are_still_refused(url: str, header: str) -> None:
    response = httpx.post(url + "/v1/completions", json=GREEDY, headers={"Authorization": header}, timeout=PATIENCE)
    assert response.status_code == 401


# ---- a client gone mid-body --------------------------------------------------------------------------------------
def test_a_client_reset_mid_body_logs_no_traceback(running: Daemon, http: httpx.Client, greedy_text: str) -> None:
    url = running.url
    host, port = urlsplit(url).hostname, urlsplit(url).port
    for _ in range(3):
        with socket.create_connection((host, port), timeout=PATIENCE) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n"
                         b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{\"prompt\": \"ab")
            time.sleep(0.2)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")  # RST
    assert completion_text(http) == greedy_text
    log = Path(running.log.name).read_text(errors="replace")
    assert "Exception in ASGI application" not in log and "Traceback" not in log


# ---- browsers -----------------------------------------------------------------------------------------------------
KEY = {"Authorization": "Bearer sk-hostile"}


@pytest.mark.parametrize("content_type", ["text/plain", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
def test_bodies_not_sent_as_json_are_a_415(url: str, http: httpx.Client, greedy_text: str,
                                          content_type: str | None) -> None:
    """What a page can make a browser send anywhere without asking first is never parsed as JSON."""
    headers = {**KEY, **({"Content-Type": content_type} if content_type else {})}
    response = httpx.post(url + "/v1/completions", content=json.dumps(GREEDY), headers=headers, timeout=PATIENCE)
    assert response.status_code == 415
    assert response.json()["error"]["code"] == "unsupported_media_type"
    assert completion_text(http) == greedy_text


def test_json_with_a_charset_is_json(http: httpx.Client, greedy_text: str) -> None:
    response = http.post("/v1/completions", content=json.dumps(GREEDY),
                         headers={"Content-Type": "application/json; charset=utf-8"})
    assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy_text


@pytest.mark.parametrize("path", ["/v1/completions", "/reset_prefix_cache", "/tokenize"])
def test_posts_from_other_sites_pages_are_a_403(url: str, path: str) -> None:
    response = httpx.post(url + path, json={"model": MODEL, "prompt": "hi"}, timeout=PATIENCE,
                          headers={**KEY, "Origin": "https://evil.example"})
    assert response.status_code == 403
    assert response.json()["error"]["code"] == "origin_not_allowed"
    assert "access-control-allow-origin" not in response.headers


def test_the_daemons_own_pages_and_allowed_origins_may_post(url: str, greedy_text: str) -> None:
    for origin in (url, ALLOWED):
        response = httpx.post(url + "/v1/completions", json=GREEDY, timeout=PATIENCE, headers={**KEY, "Origin": origin})
        assert response.status_code == 200 and response.json()["choices"][0]["text"] == greedy_text
    assert response.headers["access-control-allow-origin"] == ALLOWED


def test_a_preflight_is_answered_for_allowed_origins_only(url: str) -> None:
    def preflight(origin: str) -> httpx.Response:
        return httpx.options(url + "/v1/chat/completions", timeout=PATIENCE, headers={
            "Origin": origin, "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type"})

    allowed = preflight(ALLOWED)
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ALLOWED
    refused = preflight("https://evil.example")
    assert "access-control-allow-origin" not in refused.headers


def test_a_read_from_another_origin_carries_no_cors_header(url: str) -> None:
    """A GET changes nothing and is served, but without CORS headers the page cannot read the answer."""
    response = httpx.get(url + "/v1/models", timeout=PATIENCE, headers={**KEY, "Origin": "https://evil.example"})
    assert response.status_code == 200 and "access-control-allow-origin" not in response.headers


def test_listening_beyond_loopback_without_a_key_is_warned_about(caplog) -> None:
    from v4serve.server.serve import ServeConfig, warn_if_open

    with socket.socket() as wide, socket.socket() as local:
        wide.bind(("0.0.0.0", 0))
        local.bind(("127.0.0.1", 0))
        with caplog.at_level("WARNING", logger="v4serve"):
            warn_if_open(ServeConfig(), [local])
            assert caplog.records == []
            warn_if_open(ServeConfig(api_key="k"), [wide])
            assert caplog.records == []
            warn_if_open(ServeConfig(), [wide])
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["listening on 0.0.0.0 without --api-key"]


@pytest.mark.parametrize("value", ["app.example.com", "https://app.example.com/path", "ftp://x"])
def test_an_origin_that_is_not_one_is_refused_at_start(value: str) -> None:
    from v4serve.server.serve import ServeConfig

    with pytest.raises(ValueError, match="--allowed-origins takes origins"):
        ServeConfig(allowed_origins=value).check_http_settings()


# ---- connections --------------------------------------------------------------------------------------------------
def open_connection(url: str) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=PATIENCE)


def closed_by_server(sock: socket.socket) -> bool:
    sock.settimeout(0.05)
    try:
        return sock.recv(1) == b""
    except TimeoutError:
        return False
    except OSError:
        return True


def closed_connections(http: httpx.Client) -> float:
    found = re.search(r'^v4serve_connections_closed_total\{[^}]*reason="header_timeout"[^}]*\} (\S+)$',
                      http.get("/metrics").text, re.M)
    assert found
    return float(found.group(1))


def test_idle_and_slow_header_connections_are_closed_and_others_served(url: str, http: httpx.Client,
                                                                       greedy_text: str) -> None:
    """Idle connections and ones that send their headers a line at a time are closed after
    --header-timeout (2 s here), and counted; meanwhile everyone else is served the same text."""
    before = closed_connections(http)
    idle = [open_connection(url) for _ in range(20)]
    slow = [open_connection(url) for _ in range(10)]
    for sock in slow:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    try:
        deadline = time.monotonic() + PATIENCE
        while not all(closed_by_server(s) for s in idle + slow):
            assert time.monotonic() < deadline, "connections were left open past --header-timeout"
            for sock in slow:
                with contextlib.suppress(OSError):
                    sock.sendall(b"X-Slow: 1\r\n")  # never the blank line that ends the headers
            assert completion_text(http) == greedy_text
            assert http.get("/health").status_code == 200
    finally:
        for sock in idle + slow:
            sock.close()
    # At least these 30 (the test's own keep-alive connection may have been closed idle too).
    assert closed_connections(http) >= before + 30


def test_connections_past_the_cap_get_503_and_are_served_once_others_go(url: str) -> None:
    """--max-connections 40 here: with 40 other connections open, a new request is refused with 503
    (retried with fresh connections, in case --header-timeout closed some first on a slow machine);
    once they are gone, it is served."""

    def status() -> int:
        return httpx.post(url + "/v1/completions", json=GREEDY, headers=KEY, timeout=PATIENCE).status_code

    deadline = time.monotonic() + PATIENCE
    while True:
        others = [open_connection(url) for _ in range(MAX_CONNECTIONS)]
        try:
            code = status()
        finally:
            for sock in others:
                sock.close()
        if code == 503:
            break
        assert code == 200 and time.monotonic() < deadline, code
    wait_until(lambda: status() == 200, "a request once the other connections are gone")


# ---- signals ------------------------------------------------------------------------------------------------------
def test_hup_and_usr2_change_nothing_and_usr1_logs_the_state(running: Daemon, http: httpx.Client,
                                                            greedy_text: str) -> None:
    """A stream runs while the signals arrive: it goes on, and SIGUSR1's dump lists it."""
    log = Path(running.log.name)
    body = {**GREEDY, "prompt": "Tell me a long story.", "max_tokens": 5000, "ignore_eos": True, "stream": True}
    with http.stream("POST", "/v1/completions", json=body) as response:
        events = (line for line in response.iter_lines() if line.startswith("data: "))
        next(events)
        for sig in (signal.SIGHUP, signal.SIGUSR2, signal.SIGUSR1):
            running.proc.send_signal(sig)
        wait_until(lambda: "state: running" in log.read_text(errors="replace"), "SIGUSR1's state dump")
        more = [next(events) for _ in range(5)]
    assert all("error" not in json.loads(e.removeprefix("data: ")) for e in more)
    assert running.proc.poll() is None
    assert completion_text(http) == greedy_text
    text = log.read_text(errors="replace")
    assert "SIGHUP: nothing to reload" in text and "SIGUSR2 ignored" in text
    assert re.search(r"state \(SIGUSR1\): \d+ running, \d+ waiting; State Cache \d+%, Block Cache \d+% used", text)
    assert re.search(r"state: running \S+ age [0-9.]+s prompt 22 output \d+ computed \d+ running", text), text[-2000:]


# ---- every list has a bound, checked before any work ---------------------------------------------------------------
@pytest.mark.parametrize(("endpoint", "field", "value", "says"), [
    ("/v1/completions", "stop_token_ids", [300] * 200_000, "at most 1024 items"),
    ("/v1/completions", "logit_bias", {str(i): 1 for i in range(2000)}, "at most 1024 items"),
    ("/v1/completions", "prompt", [""] * 300_000, "at most 64 prompts per request"),
    ("/v1/completions", "prompt", [[5]] * 100, "at most 64 prompts per request"),
    ("/v1/chat/completions", "tools", [{"type": "function", "function": {"name": f"t{i}"}} for i in range(200)],
     "at most 128 items"),
])
def test_oversized_lists_are_a_400_before_any_work(http: httpx.Client, greedy_text: str, endpoint: str, field: str,
                                                  value: Any, says: str) -> None:
    body = {**(GREEDY if endpoint == "/v1/completions" else chat()), field: value}
    response = http.post(endpoint, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == field and says in error["message"], error
    assert completion_text(http) == greedy_text


def test_prompts_times_n_are_counted_before_tokenizing(http: httpx.Client) -> None:
    response = http.post("/v1/completions", json={**GREEDY, "prompt": ["a"] * 8, "n": 16})
    assert_refused(response, 400, "prompt", "at most 64 prompts × n per request")


def test_a_request_past_its_token_ceiling_is_a_400_naming_the_knob(http: httpx.Client, greedy_text: str) -> None:
    """--max-request-tokens is 16 × max-model-len by default: prompts plus n × max_tokens, a missing
    max_tokens counting as the rest of the context. At the ceiling a request is admitted (its stream
    starts; closing it aborts the work), one token over is refused before any work."""
    ceiling = 16 * http.get("/v1/models").json()["data"][0]["context_length"]
    prompt = [65 + i % 26 for i in range(16)]
    per_choice = (ceiling - 4 * len(prompt)) // 64
    body = {"model": MODEL, "prompt": [prompt] * 4, "n": 16, "max_tokens": per_choice, "temperature": 0}
    assert 4 * len(prompt) + 64 * per_choice == ceiling
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as admitted:
        assert admitted.status_code == 200
    over = http.post("/v1/completions", json={**body, "prompt": [prompt + [65]] + [prompt] * 3})
    assert_refused(over, 400, "max_tokens", "(--max-request-tokens)")
    assert f"may cost {ceiling + 1} tokens" in over.json()["error"]["message"]
    no_max = http.post("/v1/completions", json={**body, "max_tokens": None})
    assert_refused(no_max, 400, "max_tokens", f"at most {ceiling}")
    assert completion_text(http) == greedy_text


# ---- nothing grows without bound ----------------------------------------------------------------------------------
def test_compiled_grammars_are_kept_least_recently_used_within_their_bound() -> None:
    from v4serve.engine.request import GrammarSpec
    from v4serve.engine.structured import Grammars

    tokenizer = ByteTokenizer()
    grammars = Grammars(tokenizer.vocabulary_json(), tokenizer.vocab_size, tokenizer.eos_token_id,
                        max_text_bytes=2000)

    def spec(i: int) -> GrammarSpec:
        schema = {"type": "string", "enum": [f"choice-{i}-{j}" for j in range(20)]}
        return GrammarSpec("json_schema", json.dumps(schema), param="response_format")

    size = len(spec(0).text)
    for i in range(30):
        grammars.check(spec(i))
        grammars.check(spec(0))  # kept in use: never the least recently used
    assert 2000 - 2 * size < grammars.text_bytes <= 2000  # full, and within its bound
    compiled = grammars.compiles
    grammars.check(spec(0))
    grammars.check(spec(29))
    assert grammars.compiles == compiled  # both still kept
    grammars.check(spec(1))
    assert grammars.compiles == compiled + 1  # long gone: compiled again


def grammar_numbers(http: httpx.Client) -> dict[tuple[str, str], float]:
    text = http.get("/metrics").text
    return {(m.group(1), m.group(2)): float(m.group(3)) for m in re.finditer(
        r'^v4serve_grammar_(cache_bytes|compiles_total)\{[^}]*process="(\w+)"[^}]*\} (\S+)$', text, re.M)}


def test_compiled_grammars_are_measured_in_both_processes(http: httpx.Client) -> None:
    """A new schema is compiled once by the front end (its check, before the first byte) and once by the
    engine process (its matcher); both keep its text within their bound, and /metrics shows it."""
    schema = {"type": "string", "enum": [f"measured-{time.monotonic_ns()}-{j}" for j in range(10)]}
    before = grammar_numbers(http)
    response = http.post("/v1/chat/completions", json=chat(max_tokens=4, response_format=json_schema(schema)))
    assert response.status_code == 200, response.text
    after = grammar_numbers(http)
    wait_until(lambda: grammar_numbers(http)[("compiles_total", "engine")] == before[("compiles_total", "engine")] + 1,
               "the engine's compile in /metrics")
    assert after[("compiles_total", "front_end")] == before[("compiles_total", "front_end")] + 1
    for process in ("front_end", "engine"):
        assert 0 < grammar_numbers(http)[("cache_bytes", process)] <= 8 << 20


# ---- the prompt's logprobs: computed once per prompt --------------------------------------------------------------
def test_echoed_prompt_logprobs_are_computed_once_and_shared_by_every_choice(http: httpx.Client) -> None:
    """`echo` + `logprobs` with n=4: one choice computes the prompt's logprobs, the other three reuse its
    prefix from the cache (140 tokens: one 128-token block each), and all four report the same ones,
    those of n=1."""
    prompt = [65 + (i * 7) % 90 for i in range(140)]
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 1}
    single = http.post("/v1/completions", json={**body, "n": 1}).json()
    http.post("/reset_prefix_cache")
    before = device_hits(http)
    four = http.post("/v1/completions", json={**body, "n": 4}).json()
    want = single["choices"][0]["logprobs"]["token_logprobs"][:140]
    for choice in four["choices"]:
        assert choice["logprobs"]["token_logprobs"][:140] == want
        assert choice["logprobs"]["top_logprobs"][:140] == single["choices"][0]["logprobs"]["top_logprobs"][:140]
    # Engine stats are published after each step: wait for the one that counts the last sibling's hit.
    wait_until(lambda: device_hits(http) == before + 3 * 128, "three siblings' prefix hits in /metrics")


def device_hits(http: httpx.Client) -> float:
    metrics = http.get("/metrics").text
    found = re.search(r'^v4serve_prefix_cache_hits_total\{[^}]*source="device"[^}]*\} (\S+)$', metrics, re.M)
    assert found, metrics[:2000]
    return float(found.group(1))


# ---- a client that never reads its stream -------------------------------------------------------------------------
def never_reading(url: str, body: dict[str, Any], path: str = "/v1/completions") -> socket.socket:
    """A client that sends a streamed request and then reads nothing (a small receive window)."""
    raw = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connecting: a small window
    parts = urlsplit(url)
    sock.connect((parts.hostname, parts.port))
    sock.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n".encode()
                 + b"Content-Length: " + str(len(raw)).encode() + b"\r\n\r\n" + raw)
    return sock


def limited(http: httpx.Client, limit: str) -> float:
    found = re.search(rf'^v4serve_requests_limited_total\{{[^}}]*limit="{limit}"[^}}]*\}} (\S+)$',
                      http.get("/metrics").text, re.M)
    assert found
    return float(found.group(1))


def generated_tokens(http: httpx.Client) -> float:
    found = re.search(r"^v4serve_generation_tokens_total\{[^}]*\} (\S+)$", http.get("/metrics").text, re.M)
    assert found
    return float(found.group(1))


# Chat with 20 top logprobs: ~1.2 KB per token, so the kernel's socket buffers (~3 MB on loopback,
# whatever the client's window) fill after ~2,500 tokens and the bound is reached soon after.
NEVER_READ = {"model": MODEL, "messages": [{"role": "user", "content": "Never read"}], "max_tokens": 20000,
              "ignore_eos": True, "n": 16, "logprobs": True, "top_logprobs": 20, "stream": True}
CHAT = "/v1/chat/completions"


def test_a_stream_nobody_reads_is_held_then_ended_and_costs_nothing_meanwhile() -> None:
    """A client opens a stream (n=16, top logprobs) and never reads. Once 1500 tokens (half of
    --max-unread-tokens 3000, logprob entries included) wait unread, the engine holds its requests:
    it generates nothing more for them; held for --unread-timeout (3 s here), they end, and what the
    client reads afterwards ends with that error and [DONE]. Everyone else is served meanwhile."""
    served = start_daemon("--max-unread-tokens", "3000", "--unread-timeout", "3")
    try:
        with httpx.Client(base_url=served.url, timeout=PATIENCE) as http:
            sock = never_reading(served.url, NEVER_READ, CHAT)
            wait_until(lambda: limited(http, "unread_held") == 1, "the stream to be held")
            held_at = generated_tokens(http)
            assert completion_text(http)  # served while it is held (4 tokens)
            wait_until(lambda: limited(http, "unread_output") == 1, "the held stream to end")
            assert generated_tokens(http) <= held_at + 4 + 16 * 4  # the greedy request, and steps in flight
            assert running_requests(http) == 0
        text = read_all(sock).decode(errors="replace")
        assert "data: [DONE]" in text and "for 3 s (--unread-timeout)" in text
    finally:
        served.stop()


def test_a_slow_reader_is_held_and_resumed_and_gets_all_its_output() -> None:
    """A client that reads nothing for a while (its stream is held once 1500 tokens and logprob entries
    wait unread, after the kernel's socket buffers fill), then reads everything: its stream resumes
    and ends complete, nothing dropped."""
    served = start_daemon("--max-unread-tokens", "3000", "--unread-timeout", str(PATIENCE))
    try:
        body = {**NEVER_READ, "max_tokens": 300}
        with httpx.Client(base_url=served.url, timeout=PATIENCE) as http:
            sock = never_reading(served.url, body, CHAT)
            wait_until(lambda: limited(http, "unread_held") >= 1, "the stream to be held")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)  # now a fast reader
            events = sse_events(read_all(sock))
            assert events[-1] == "[DONE]"
            data = [json.loads(e) for e in events[:-1]]
            assert all("error" not in d for d in data)
            finished = [c for d in data for c in d["choices"] if c["finish_reason"]]
            assert sorted(c["index"] for c in finished) == list(range(16))
            assert {c["finish_reason"] for c in finished} == {"length"}
            per_choice = [sum(len(c["logprobs"]["content"]) for d in data for c in d["choices"]
                              if c["index"] == i and c["logprobs"]) for i in range(16)]
            assert per_choice == [300] * 16
            assert limited(http, "unread_output") == 0
    finally:
        served.stop()


def sse_events(response: bytes) -> list[str]:
    """The `data:` payloads of a raw HTTP/1.1 response with a chunked body."""
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200") and b"chunked" in head.lower(), head
    joined = b""
    while body:
        size_line, _, rest = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            break
        joined, body = joined + rest[:size], rest[size + 2:]
    return [line[6:] for line in joined.decode().split("\n") if line.startswith("data: ")]


def running_requests(http: httpx.Client) -> float:
    found = re.search(r"^v4serve_requests_running\{[^}]*\} (\S+)$", http.get("/metrics").text, re.M)
    assert found
    return float(found.group(1))


def read_all(sock: socket.socket) -> bytes:
    sock.settimeout(PATIENCE)
    chunks = []
    while chunk := sock.recv(1 << 16):
        chunks.append(chunk)
        if b"data: [DONE]" in b"".join(chunks[-2:]):
            break
    sock.close()
    return b"".join(chunks)


# ---- what a request may return --------------------------------------------------------------------------------------
def test_echoed_logprobs_past_the_bound_are_a_400_up_front(http: httpx.Client, greedy_text: str) -> None:
    """--max-logprob-entries 1500 here: 80 prompt tokens × n 4 × (4 + 1) = 1600."""
    body = {"model": MODEL, "prompt": [65 + i % 90 for i in range(80)], "max_tokens": 1, "echo": True,
            "logprobs": 4, "n": 4}
    assert_refused(http.post("/v1/completions", json=body), 400, "logprobs", "would return 1600 logprob entries")
    assert completion_text(http) == greedy_text


def test_generated_logprobs_past_the_bound_end_the_request_with_a_400(http: httpx.Client, greedy_text: str) -> None:
    body = {**GREEDY, "max_tokens": 600, "ignore_eos": True, "logprobs": 4}
    assert_refused(http.post("/v1/completions", json=body), 400, "logprobs", "(--max-logprob-entries")
    with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
        events = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["param"] == "logprobs" and f"passed {MAX_LOGPROB_ENTRIES} entries" in error["message"]
    returned = sum(len(json.loads(e)["choices"][0]["logprobs"]["tokens"]) for e in events[:-2])
    # Ended at the output that passed the bound (1 token per step, 5 entries per token).
    assert MAX_LOGPROB_ENTRIES // 5 <= returned <= MAX_LOGPROB_ENTRIES // 5 + 4
    assert completion_text(http) == greedy_text


def test_refusals_and_ends_by_a_bound_are_counted_by_limit(url: str, http: httpx.Client) -> None:
    def counts() -> dict[str, float]:
        text = http.get("/metrics").text
        return {m.group(1): float(m.group(2)) for m in
                re.finditer(r'^v4serve_requests_limited_total\{[^}]*limit="(\w+)"[^}]*\} (\S+)$', text, re.M)}

    before = counts()
    assert set(before) == {"unread_held", "unread_output", "logprob_entries", "request_tokens", "media_type",
                           "origin"}
    httpx.post(url + "/v1/completions", content=b"{}", headers={**KEY, "Content-Type": "text/plain"}, timeout=PATIENCE)
    httpx.post(url + "/reset_prefix_cache", headers={**KEY, "Origin": "https://evil.example"}, timeout=PATIENCE)
    http.post("/v1/completions", json={**GREEDY, "prompt": [65] * 300, "echo": True, "logprobs": 20, "n": 4})
    http.post("/v1/completions", json={**GREEDY, "prompt": ["a"] * 4, "n": 16, "max_tokens": None})
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"unread_held": 0, "unread_output": 0, "logprob_entries": 1,
                                                        "request_tokens": 1, "media_type": 1, "origin": 1}


# ---- grammar compiles: one per grammar, none for a client that has gone -------------------------------------------
def test_requests_bringing_the_same_new_grammar_at_once_compile_it_once() -> None:
    from concurrent.futures import ThreadPoolExecutor

    from v4serve.engine.request import GrammarSpec
    from v4serve.engine.structured import Grammars

    tokenizer = ByteTokenizer()
    grammars = Grammars(tokenizer.vocabulary_json(), tokenizer.vocab_size, tokenizer.eos_token_id)
    schema = {"type": "string", "enum": [f"same-{j}" for j in range(3000)]}  # long enough to overlap
    spec = GrammarSpec("json_schema", json.dumps(schema), param="response_format")
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda _: grammars.check(spec), range(4)))
    assert grammars.compiles == 1


class SlowGrammarChecks:
    """An engine whose grammar checks hold until released: compiles that take long (the injected fault)."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.checked: list[str] = []

    def silent_for(self) -> float:
        return 0.0

    def check(self, requests: list[Any]) -> None:
        self.checked.append(requests[0].request_id)
        assert self.release.wait(PATIENCE)


class Gone:
    """The raw request of a client that has disconnected."""

    async def is_disconnected(self) -> bool:
        return True


def test_a_grammar_compile_queued_for_a_client_that_has_gone_never_starts() -> None:
    """Both grammar compiler threads busy; a third request's client leaves while its compile waits: it
    gets 499 at once and its compile never runs, while the two under way finish."""
    import asyncio

    from v4serve.engine.request import GrammarSpec
    from v4serve.engine.stats import EngineStats
    from v4serve.server.errors import ApiError
    from v4serve.server.generation import GRAMMAR_COMPILERS, FrontEnd, ServerConfig
    from v4serve.server.metrics import Metrics
    from v4serve.server.protocol import SamplingFields
    from v4serve.server.text.output import OutputOptions

    engine = SlowGrammarChecks()
    front = FrontEnd(engine, ByteTokenizer(), ServerConfig("m", 4096), Metrics("m", EngineStats))  # type: ignore[arg-type]
    spec = GrammarSpec("json_schema", '{"type": "string"}', param="response_format")

    def generation(rid: str) -> Any:
        return front.generation(rid, [65, 66], SamplingFields(), 4, None, OutputOptions(), grammar=spec)

    async def run() -> None:
        busy = [asyncio.ensure_future(front.check([generation(f"busy-{i}")])) for i in range(GRAMMAR_COMPILERS)]
        await asyncio.to_thread(wait_until, lambda: len(engine.checked) == GRAMMAR_COMPILERS, "both compiles started")
        with pytest.raises(ApiError) as gone:
            await front.check([generation("gone")], Gone())  # type: ignore[arg-type]
        assert gone.value.status == 499
        engine.release.set()
        await asyncio.gather(*busy)

    asyncio.run(run())
    front._compilers.shutdown(wait=True)  # whatever was queued has run (or was cancelled) by now
    assert sorted(engine.checked) == ["busy-0-0", "busy-1-0"]
