"""Hostile clients against one real daemon (the tiny model): requests that are valid on the wire but
malformed in meaning, or meant to break out of what the server builds from them, get a clear 4xx in
OpenAI's error shape, and the daemon keeps serving everyone else the same tokens."""

from __future__ import annotations

import contextlib
import json
import os
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
from tests.hostile_peer import HandOver, HostileProducer
from tests.test_store_daemon import metric
from v4serve.cache.kv_transfer import PATH
from v4serve.cache.peer_auth import PEER_HEADER, request_proof
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


def test_patterns_are_checked_where_they_are_regexes_only() -> None:
    """`pattern` values and `patternProperties` keys must compile; the same words inside data (a `default`,
    an `enum`) are not regexes."""
    from v4serve.server.errors import ApiError
    from v4serve.server.tools import plan_tools

    def tool(parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    plan_tools([tool({"type": "object", "default": {"pattern": "(ab"}, "properties": {
        "pattern": {"type": "string", "enum": [{"pattern": "a{2,1}"}]}}})], "auto", None)
    with pytest.raises(ApiError) as refused:
        plan_tools([tool({"type": "object", "patternProperties": {"(ab": {"type": "string"}}})], "auto", None)
    assert "'(ab' is not a 'regex'" in refused.value.message


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


@pytest.fixture(scope="module")
def capped() -> Iterator[Daemon]:
    """--max-connections 2, and idle connections kept for a minute (a connection is evicted once idle for a
    second: the minute between leaves the tests time however slow this machine is)."""
    served = start_daemon("--max-connections", "2", "--header-timeout", "60", "--keep-alive-timeout", "60",
                          "--max-unread-tokens", "3000", "--unread-timeout", str(PATIENCE))
    try:
        yield served
    finally:
        served.stop()


def test_idle_connections_at_the_cap_never_shut_anyone_out(capped: Daemon, greedy_text: str) -> None:
    """With more idle connections open than --max-connections, a new connection closes the one idle
    longest instead of being refused, so /health, /metrics and requests are all served (they were all 503
    until --header-timeout closed the idle ones)."""
    url = capped.url
    before = metric(url, "v4serve_connections_closed_total", reason="idle_evicted")
    idle = [open_connection(url) for _ in range(2 + 10)]
    try:
        assert httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
        assert httpx.get(url + "/metrics", headers=KEY, timeout=PATIENCE).status_code == 200
        with httpx.Client(base_url=url, timeout=PATIENCE, headers=KEY) as fresh:
            assert completion_text(fresh) == greedy_text
        # Each new connection closes one idle for a second or more (each probe here opens one).
        wait_until(lambda: httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
                   and metric(url, "v4serve_connections_closed_total", reason="idle_evicted") >= before + 10,
                   "idle connections closed to make room")
        assert sum(closed_by_server(sock) for sock in idle) >= 10
    finally:
        for sock in idle:
            sock.close()


def test_requests_past_the_cap_get_503_but_the_probes_are_answered(capped: Daemon) -> None:
    """--max-connections 2: two streams running (held: their clients read nothing), a third request gets
    503 with Retry-After while /health and /metrics still answer; once the streams go it is served."""
    url = capped.url
    with httpx.Client(base_url=url, timeout=PATIENCE) as http:
        streams = [never_reading(url, {**NEVER_READ, "n": 1}, CHAT) for _ in range(2)]
        try:
            # Running, each past the cap's count (the engine has them), and for minutes yet: 20000
            # tokens, held at 1500 unread until --unread-timeout (PATIENCE).
            wait_until(lambda: engine_running(http) == 2, "both streams to run")
            third = http.post("/v1/completions", json=GREEDY)
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["code"] == "server_overloaded" and "--max-connections" in third.text
            assert http.get("/health").status_code == 200 and http.get("/metrics").status_code == 200
        finally:
            for sock in streams:
                sock.close()
        wait_until(lambda: http.post("/v1/completions", json=GREEDY).status_code == 200,
                   "a request once the streams are gone")
        assert limited(http, "requests_at_once") >= 1


def test_pipelined_requests_are_answered_in_order(url: str) -> None:
    """HTTP/1.1 pipelining: three requests sent at once on one connection get three answers, in order."""
    body = json.dumps(GREEDY).encode()
    post = (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n"
            b"Content-Type: application/json\r\nContent-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
    models = b"GET /v1/models HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer sk-hostile\r\n\r\n"
    health = b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n"
    markers = (b'"text_completion"', b'"object":"list"', b'{"status":"ok"}')
    with open_connection(url) as sock:
        sock.sendall(post + models + health)
        received = b""
        while not all(marker in received for marker in markers):
            chunk = sock.recv(1 << 16)
            assert chunk, received
            received += chunk
    assert received.count(b"HTTP/1.1 200 OK") == 3
    order = [received.index(marker) for marker in markers]
    assert order == sorted(order)


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


def engine_running(http: httpx.Client) -> float:
    found = re.search(r"^v4serve_requests_running\{[^}]*\} (\S+)$", http.get("/metrics").text, re.M)
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
                           "origin", "requests_at_once", "preprocess_cpu", "body_containers"}
    httpx.post(url + "/v1/completions", content=b"{}", headers={**KEY, "Content-Type": "text/plain"}, timeout=PATIENCE)
    httpx.post(url + "/reset_prefix_cache", headers={**KEY, "Origin": "https://evil.example"}, timeout=PATIENCE)
    http.post("/v1/completions", json={**GREEDY, "prompt": [65] * 300, "echo": True, "logprobs": 20, "n": 4})
    http.post("/v1/completions", json={**GREEDY, "prompt": ["a"] * 4, "n": 16, "max_tokens": None})
    after = counts()
    assert {k: after[k] - before[k] for k in after} == {"unread_held": 0, "unread_output": 0, "logprob_entries": 1,
                                                        "request_tokens": 1, "media_type": 1, "origin": 1,
                                                        "requests_at_once": 0, "preprocess_cpu": 0,
                                                        "body_containers": 0}


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


# ---- a third round: secrets, a frozen front end, credentials, byte bounds ------------------------------------------
class Beside:
    """An innocent greedy client and a /health poller, each on a thread, while a case runs: afterwards every
    innocent request got 200 and the greedy text, every /health 200, and each ran at least once after the
    case began."""

    def __init__(self, url: str, greedy_text: str, headers: dict[str, str] | None = None) -> None:
        self.url, self.greedy_text, self.headers = url, greedy_text, headers or KEY
        self.stop = threading.Event()
        self.innocent: list[tuple[int, str]] = []
        self.health: list[tuple[float, float, int]] = []  # (sent, answered, status), time.monotonic()
        self.threads = [threading.Thread(target=self._innocent), threading.Thread(target=self._health)]

    def __enter__(self) -> Beside:
        for thread in self.threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        rounds = len(self.innocent), len(self.health)
        wait_until(lambda: len(self.innocent) > rounds[0] and len(self.health) > rounds[1], "the probes' next round")
        self.stop.set()
        for thread in self.threads:
            thread.join(PATIENCE)
        if exc[0] is None:
            assert self.innocent and all(r == (200, self.greedy_text) for r in self.innocent), self.innocent[:3]
            assert all(status == 200 for _, _, status in self.health)

    def _innocent(self) -> None:
        with httpx.Client(base_url=self.url, timeout=PATIENCE, headers=self.headers) as client:
            while not self.stop.is_set():
                response = client.post("/v1/completions", json=GREEDY)
                self.innocent.append((response.status_code, response.json()["choices"][0]["text"]
                                      if response.status_code == 200 else response.text))

    def _health(self) -> None:
        with httpx.Client(base_url=self.url, timeout=PATIENCE) as client:
            while not self.stop.is_set():
                sent = time.monotonic()
                status = client.get("/health").status_code
                self.health.append((sent, time.monotonic(), status))
                time.sleep(0.02)


def no_key_in(text: str, keys: list[str]) -> None:
    assert not any(key in text for key in keys), "a key reached a client"


KEYS = [f"sk-{i}-{'0123456789abcdef' * 2}" for i in range(3)]


def write_file(path: Path, data: bytes) -> None:
    tmp = path.with_suffix(".new")
    tmp.write_bytes(data)
    tmp.replace(path)


def test_the_keys_file_fuzzed_during_requests_never_leaks_a_key_or_fails_a_request(tmp_path: Path) -> None:
    """The keys file is rewritten with a Latin-1 comment (valid: comments are bytes), binary junk, 33 MB,
    nothing, and then removed, while an innocent client and a /health poller run: no answer is a 500, no
    answer holds a byte of any key, and the keys of the last good file stay in force (once a key with a
    non-UTF-8 comment beside it made every request a 500 quoting the whole file)."""
    keys = tmp_path / "keys"
    keys.write_bytes(f"{KEYS[0]} acme\n".encode())
    served = start_daemon("--api-keys-file", str(keys))
    log = Path(served.log.name)
    answers: list[httpx.Response] = []

    def reads() -> int:
        return len(re.findall(r"tenants: keys file \S+ (?:not )?reloaded", log.read_text(errors="replace")))

    def looked_at(count: int) -> None:
        wait_until(lambda: reads() >= count, "the keys file read again")

    def ask(key: str | None) -> int:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        response = httpx.post(served.url + "/v1/completions", json=GREEDY, headers=headers, timeout=PATIENCE)
        answers.append(response)
        return response.status_code

    try:
        headers = {"Authorization": f"Bearer {KEYS[0]}"}
        with httpx.Client(base_url=served.url, timeout=PATIENCE, headers=headers) as client:
            greedy_text = completion_text(client)
        with Beside(served.url, greedy_text, headers=headers):
            write_file(keys, f"# caf\xe9 team\n{KEYS[0]} acme\n{KEYS[1]} globex  # \xff\n".encode("latin-1"))
            wait_until(lambda: ask(KEYS[1]) == 200, "the Latin-1 commented file's keys")
            seen = reads()
            for bad in (b"\x00\x01\x02\xff\xfe junk\n\x80\x81 \x82\n", b"# " + b"x" * (33 << 20) + b"\n", b""):
                write_file(keys, bad)
                seen += 1
                looked_at(seen)
                assert (ask(KEYS[0]), ask(KEYS[1]), ask(KEYS[2]), ask(None)) == (200, 200, 401, 401)
            keys.unlink()
            looked_at(seen + 1)
            assert (ask(KEYS[1]), ask(None)) == (200, 401)
    finally:
        served.stop()
    for response in answers:
        assert response.status_code != 500
        no_key_in(response.text, KEYS)
    text = log.read_text(errors="replace")
    assert "line 1: a key must be 1-512 visible ASCII characters" in text
    assert "more than a keys file may be" in text and "holds no keys" in text and "No such file" in text
    no_key_in(text, KEYS)  # the log names lines, never a key


def test_an_unexpected_failure_is_a_500_with_an_id_and_no_text(monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    from tests.daemon import in_process_server
    from v4serve.server.generation import FrontEnd
    from v4serve.server.serve import ServeConfig

    def broken(self: object, name: str | None) -> str:
        raise RuntimeError("secret-token-in-an-exception")

    with in_process_server(ServeConfig(no_kv_store=True, preprocess_workers=0)) as (url, _):
        monkeypatch.setattr(FrontEnd, "check_model", broken)
        with caplog.at_level("ERROR"):
            response = httpx.post(url + "/v1/completions", json=GREEDY, timeout=PATIENCE)
    assert response.status_code == 500 and "secret" not in response.text
    error = response.json()["error"]
    assert error["code"] == "internal_error" and error["message"].startswith("internal error (err_")
    error_id = error["message"].split("(", 1)[1].split(";", 1)[0]
    assert any(error_id in r.getMessage() for r in caplog.records)


# Each: a single request of at most 4 MiB that is costly to prepare (a tool schema of 10,000 properties to
# check, render and tokenize), or that the front end must refuse without building a reply of tens of MB.
BIG_SCHEMA = {"type": "object", "properties": {f"p{i}": {"type": "string", "description": "x" * 40}
                                               for i in range(10_000)}}
BIG_TOOL = {"type": "function", "function": {"name": "big", "parameters": BIG_SCHEMA}}


@pytest.mark.parametrize(("path", "body", "status", "says"), [
    ("/v1/chat/completions", chat(max_tokens=4, tools=[BIG_TOOL], tool_choice="none"), 200, None),
    ("/v1/chat/completions", chat(max_tokens=4, tools=[BIG_TOOL],
                                  tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
     "tool_choice names 'nope', which is not among the tools"),
    ("/v1/responses", {"model": MODEL, "input": "hi", "max_output_tokens": 4,
                       "tools": [{"type": "function", "name": "big", "parameters": BIG_SCHEMA}]}, 400,
     "maximum context length"),
    ("/v1/chat/completions/render", {"model": MODEL, "messages": [{"role": "user", "content": "a" * 3_900_000}]}, 400,
     "maximum context length"),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "a"}] * 150_000}]}, 400, "JSON objects and arrays"),
], ids=["tools-none", "tool-missing", "responses-tools", "render-3.9MB", "count_tokens-150k-blocks"])
def test_a_costly_request_is_answered_while_everyone_else_is_served(url: str, greedy_text: str, path: str,
                                                                   body: dict[str, Any], status: int,
                                                                   says: str | None) -> None:
    """Rendering, tokenizing and checking tools run in preprocessing workers, so these leave the front end
    free (bench/bench_load.py --heavy-only measures /health and the innocent client beside each); a render
    obeys max-model-len (it once returned 35 MB), a body of 150,000 content blocks is refused before
    pydantic spends half a second on it."""
    with Beside(url, greedy_text):
        response = httpx.post(url + path, json=body, headers=KEY, timeout=PATIENCE)
    assert response.status_code == status, response.text[:500]
    if says is not None:
        assert says in response.text
    assert len(response.content) < 10_000


@pytest.fixture(scope="module")
def bounded() -> Iterator[Daemon]:
    """A daemon keeping at most 250,000 bytes of stored responses."""
    served = start_daemon("--responses-store-bytes", "250000")
    try:
        yield served
    finally:
        served.stop()


def test_preprocessing_past_its_cpu_bound_is_a_400_and_the_front_end_answers_meanwhile() -> None:
    """--max-preprocess-seconds 0.05: a call forced to a tool of 16,000 properties (about 0.5 s of a worker's
    CPU time here to render and build its grammar: ten times the bound) is refused once it has used the
    bound. Meanwhile /health keeps answering: polls sent during it come back before it ends (with the work
    on the event loop none could)."""
    schema = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(16_000)}}
    tool = {"type": "function", "function": {"name": "big", "parameters": schema}}
    bounded = start_daemon("--max-preprocess-seconds", "0.05")
    try:
        with httpx.Client(base_url=bounded.url, timeout=PATIENCE) as client:
            greedy_text = completion_text(client)
            with Beside(bounded.url, greedy_text, headers={}) as beside:
                started = time.monotonic()
                response = client.post("/v1/chat/completions", json=chat(tools=[tool], tool_choice="required"))
                ended = time.monotonic()
            assert response.status_code == 400 and response.json()["error"]["code"] == "request_too_costly"
            assert "--max-preprocess-seconds" in response.json()["error"]["message"]
            during = [p for p in beside.health if started + 0.05 < p[0] and p[1] < ended]
            assert during, (started, ended, beside.health[:5])
            assert metric(bounded.url, "v4serve_requests_limited_total", limit="preprocess_cpu") == 1
            assert completion_text(client) == greedy_text  # its worker was replaced; serving goes on
    finally:
        bounded.stop()


# ---- credentials mean one thing ------------------------------------------------------------------------------------
@pytest.mark.parametrize("headers", [
    [("Authorization", "Bearer bogus"), ("x-api-key", "sk-hostile")],
    [("Authorization", "Bearer sk-hostile"), ("Authorization", "Bearer bogus")],
    [("x-api-key", "sk-hostile"), ("x-api-key", "bogus")],
], ids=["bearer-vs-x-api-key", "two-authorizations", "two-x-api-keys"])
def test_credentials_that_disagree_are_a_401(url: str, headers: list[tuple[str, str]]) -> None:
    """Once the key check took one header and the stored response's owner the other: a bogus bearer token
    beside a valid x-api-key passed, and any tenant sending the same bogus token read the response."""
    response = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
                          headers=headers, timeout=PATIENCE)
    assert response.status_code == 401 and "different API keys" in response.json()["error"]["message"]


def test_one_key_in_both_headers_is_one_caller(url: str) -> None:
    both = [("Authorization", "Bearer sk-hostile"), ("x-api-key", "sk-hostile")]
    made = httpx.post(url + "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2},
                      headers=both, timeout=PATIENCE)
    assert made.status_code == 200, made.text
    found = httpx.get(url + f"/v1/responses/{made.json()['id']}", headers={"x-api-key": "sk-hostile"},
                      timeout=PATIENCE)
    assert found.status_code == 200 and found.json()["id"] == made.json()["id"]


# ---- everything kept has a byte bound ------------------------------------------------------------------------------
@pytest.mark.parametrize("metadata", [{f"k{i}": "v" for i in range(17)}, {"k" * 65: "v"}, {"k": "v" * 513}],
                         ids=["17-pairs", "65-char-key", "513-char-value"])
def test_metadata_past_openais_limits_is_a_400(http: httpx.Client, metadata: dict[str, str]) -> None:
    response = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 2,
                                                "metadata": metadata})
    assert response.status_code == 400 and response.json()["error"]["param"].startswith("metadata")


def test_stored_responses_are_bounded_in_bytes(bounded: Daemon) -> None:
    """--responses-store-bytes 250000: responses of ~100 KB each (input, ids, metadata) — the third pushes
    out the first, least recently used; a follow-up of the first is then a 404, of the others a 200."""
    with httpx.Client(base_url=bounded.url, timeout=PATIENCE) as client:
        def made(i: int) -> str:
            # Distinct at the end: the second and third hit the first's prefix, so only it is prefilled.
            body = {"model": MODEL, "input": "word " * 4000 + str(i), "max_output_tokens": 2,
                    "metadata": {f"k{j}": "v" * 512 for j in range(16)}}
            response = client.post("/v1/responses", json=body)
            assert response.status_code == 200, response.text
            return response.json()["id"]

        ids = [made(i) for i in range(3)]
        status = [client.get(f"/v1/responses/{i}").status_code for i in ids]
    assert status == [404, 200, 200]


def test_stored_responses_count_every_kept_byte() -> None:
    from array import array

    from v4serve.server.responses import StoredResponse, StoredResponses

    def response(size: int) -> StoredResponse:
        return StoredResponse({"metadata": {"k": "v" * size}}, "owner", [{"role": "user", "content": "x" * size}],
                              ("tools" * size,), array("i", [1] * size))

    store = StoredResponses(max_bytes=10_000)
    store.put("a", response(500))  # 500 + 500 + 2,500 + 2,000 = 5,500 bytes and a few per container
    assert 5_500 < store.bytes < 5_600
    store.put("b", response(500))
    assert len(store) == 1 and store.get("b", "owner")  # a went, least recently used
    store.put("huge", response(5_000))  # larger than the whole store: not kept
    assert len(store) == 1 and store.bytes < 5_600


# ---- small defects -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("field", "value"), [("max_tokens", True), ("n", "2"), ("max_tokens", 4.0)])
def test_integer_fields_are_strict(http: httpx.Client, field: str, value: object) -> None:
    response = http.post("/v1/completions", json={**GREEDY, field: value})
    assert response.status_code == 400 and response.json()["error"]["param"] == field


def test_errors_quote_at_most_a_short_prefix_of_what_was_sent(http: httpx.Client) -> None:
    long_id = "resp_" + "x" * 3_000_000
    missing = http.post("/v1/responses", json={"model": MODEL, "input": "hi", "previous_response_id": long_id})
    assert missing.status_code == 404 and len(missing.content) < 2_000
    unknown = http.post("/v1/completions", json={**GREEDY, "model": "m" * 1_000_000})
    assert unknown.status_code == 404 and len(unknown.content) < 2_000


def test_seeded_choices_are_independent_streams(http: httpx.Client) -> None:
    """Choice j of seed s once drew from seed s + j, so seeds 5 and 6 shared three of four choices."""
    def choices(seed: int) -> list[str]:
        body = {**GREEDY, "max_tokens": 12, "temperature": 1.0, "seed": seed, "n": 4, "ignore_eos": True}
        response = http.post("/v1/completions", json=body)
        assert response.status_code == 200
        return [c["text"] for c in sorted(response.json()["choices"], key=lambda c: c["index"])]

    five, six = choices(5), choices(6)
    assert five == choices(5)  # a seed still repeats
    assert not any(five[j] == six[j - 1] for j in range(1, 4))
    single = http.post("/v1/completions", json={**GREEDY, "max_tokens": 12, "temperature": 1.0, "seed": 5,
                                                "ignore_eos": True}).json()["choices"][0]["text"]
    assert single == five[0]  # choice 0 is the seed's own stream


def test_logprobs_under_a_json_schema_are_finite(http: httpx.Client) -> None:
    """The grammar masks tokens to -inf; listed as alternatives they once made the reply's JSON invalid (a
    500, for every config). An alternative the grammar forbids is not listed."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    for stream in (False, True):
        body = chat(max_tokens=20, logprobs=True, top_logprobs=2, stream=stream,
                    response_format=json_schema(schema))
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 200, response.text
        text = response.text
        assert "Infinity" not in text and "NaN" not in text
        chunks = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("data: {")] if stream \
            else [response.json()]
        entries = [e for c in chunks for choice in c["choices"]
                   for e in (choice["logprobs"] or {}).get("content") or []]
        assert entries and all(-1e9 < t["logprob"] <= 0 for e in entries for t in [e, *e["top_logprobs"]])


def test_a_schema_nested_past_what_the_checker_can_walk_is_a_400() -> None:
    """The schema checker recurses once per level (and more per `anyOf`): past Python's recursion limit
    that was a RecursionError, a 500."""
    from v4serve.server.errors import ApiError
    from v4serve.server.tools import plan_tools

    deep: dict[str, Any] = {"type": "string"}
    for _ in range(2000):
        deep = {"anyOf": [deep, {"type": "null"}]}
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {"a": deep}}}}
    with pytest.raises(ApiError) as refused:
        plan_tools([tool], "auto", None)
    assert refused.value.status == 400 and "nests too deeply" in refused.value.message


def _nested(levels: int) -> dict[str, Any]:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"not": schema}
    return schema


def test_schema_nesting_is_bounded_at_its_limit() -> None:
    """MAX_SCHEMA_DEPTH levels are checked; one more is refused before the (native) checker walks it."""
    from v4serve.server.errors import ApiError
    from v4serve.server.tools import MAX_SCHEMA_DEPTH, plan_tools

    def tool(parameters: dict[str, Any]) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "f", "parameters": parameters}}

    for levels in (MAX_SCHEMA_DEPTH - 1, MAX_SCHEMA_DEPTH):
        plan_tools([tool({"type": "object", **_nested(levels)})], "auto", None)  # the tool's schema is level 1
    with pytest.raises(ApiError) as refused:
        plan_tools([tool({"type": "object", **_nested(MAX_SCHEMA_DEPTH + 1)})], "auto", None)
    assert refused.value.status == 400 and "nests too deeply" in refused.value.message
    with pytest.raises(ApiError) as deeper:  # past where a native walk would crash the worker
        plan_tools([tool({"type": "object", **_nested(50_000)})], "auto", None)
    assert "nests too deeply" in deeper.value.message


def test_a_schemas_own_meta_schema_url_is_never_fetched() -> None:
    """A `$schema` naming any URL but the drafts the checker has built in is not fetched (a request must not
    make the server send requests): the schema is checked against the default draft instead."""
    import http.server

    from v4serve.server.errors import ApiError
    from v4serve.server.tools import plan_tools

    asked: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            asked.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b'{"type": "object"}')

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    meta = f"http://127.0.0.1:{server.server_address[1]}/meta"
    try:
        good = {"$schema": meta, "type": "object", "properties": {"a": {"type": "string"}}}
        plan_tools([{"type": "function", "function": {"name": "f", "parameters": good}}], "auto", None)
        bad = {"$schema": meta, "type": "object", "properties": {"a": {"type": 12}}}
        with pytest.raises(ApiError) as refused:
            plan_tools([{"type": "function", "function": {"name": "f", "parameters": bad}}], "auto", None)
        assert "is not a valid JSON schema" in refused.value.message
        draft7 = {"$schema": "http://json-schema.org/draft-07/schema#", "type": "object", "minimum": "x"}
        with pytest.raises(ApiError):  # a built-in draft is used as named
            plan_tools([{"type": "function", "function": {"name": "f", "parameters": draft7}}], "auto", None)
    finally:
        server.shutdown()
        server.server_close()
    assert asked == []


# ---- a fourth round: hand-overs, the keys file, API servers, headers, preprocess workers ----------------------------
PEER = {"V4SERVE_KV_PEER_SECRET": "the-fleets-peer-secret-for-hostile-tests"}
PD_KEYS = "sk-acme-pd-0123456789 acme\nsk-globex-pd-0123456789 globex\n"
ACME = {"Authorization": "Bearer sk-acme-pd-0123456789"}
GLOBEX = {"Authorization": "Bearer sk-globex-pd-0123456789"}
PD_DOCUMENT = "a document handed from a prefill replica to a decode replica, block after block. " * 10


@pytest.fixture(scope="module")
def pd(tmp_path_factory) -> Iterator[dict[str, Any]]:
    """A real prefill replica, a decode replica listing it and two hostile producers beside it (one holding the
    fleet's secret: a listed replica gone bad; one without it: another process at a listed address), tenants
    on both replicas, the decode replica's fetches given 3 s and its queue 16 requests."""
    root = tmp_path_factory.mktemp("hostile-pd")
    keys = root / "keys"
    keys.write_text(PD_KEYS)
    producer = start_daemon("--kv-store-dir", str(root / "p"), "--kv-transfer-config", '{"kv_role": "kv_producer"}',
                            "--api-keys-file", str(keys), env=PEER)
    forger, impostor = HostileProducer(PEER["V4SERVE_KV_PEER_SECRET"].encode()), HostileProducer(b"x" * 32)
    port = int(producer.url.rsplit(":", 1)[1])
    consumer_config = json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {
        "fetch_timeout": 3, "producers": [f"127.0.0.1:{p}" for p in (port, forger.port, impostor.port)]}})
    consumer = None
    try:
        consumer = start_daemon("--kv-store-dir", str(root / "d"), "--kv-transfer-config", consumer_config,
                                "--api-keys-file", str(keys), "--max-waiting", "16", env=PEER)
        yield {"producer": producer, "consumer": consumer, "forger": forger, "impostor": impostor,
               "handovers": root / "p" / "handover"}
    finally:
        for d in (producer, consumer):
            if d is not None:
                d.stop()
        forger.close()
        impostor.close()


def pd_completion(prompt: str, **fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, **fields}


def prefill_leg(pd: dict[str, Any], prompt: str, headers: dict[str, str] = ACME) -> dict[str, Any]:
    """The prefill leg as vLLM's router sends it: its reply's kv_transfer_params."""
    reply = httpx.post(pd["producer"].url + "/v1/completions", headers=headers, timeout=PATIENCE,
                       json=pd_completion(prompt, max_tokens=1, kv_transfer_params={"do_remote_decode": True}))
    assert reply.status_code == 200, reply.text
    return reply.json()["kv_transfer_params"]


def cold_text(pd: dict[str, Any], prompt: str, headers: dict[str, str] = ACME) -> str:
    """What the prompt gives served whole, with nothing handed over."""
    reply = httpx.post(pd["producer"].url + "/v1/completions", json=pd_completion(prompt), headers=headers,
                       timeout=PATIENCE)
    return reply.json()["choices"][0]["text"]


def decode_leg(pd: dict[str, Any], prompt: str, params: dict[str, Any], headers: dict[str, str] = ACME
               ) -> httpx.Response:
    return httpx.post(pd["consumer"].url + "/v1/completions", headers=headers, timeout=PATIENCE,
                      json=pd_completion(prompt, kv_transfer_params=params))


def consumer_greedy(pd: dict[str, Any]) -> str:
    with httpx.Client(base_url=pd["consumer"].url, headers=ACME, timeout=PATIENCE) as client:
        return completion_text(client)


def fell_back(pd: dict[str, Any], reason: str) -> float:
    return metric(pd["consumer"].url, "v4serve_kv_transfer_fallbacks_total", reason=reason)


def received_bytes(pd: dict[str, Any]) -> float:
    return metric(pd["consumer"].url, "v4serve_kv_transfer_received_bytes_total")


def test_a_decode_leg_naming_a_clients_own_server_is_a_400_and_nothing_is_sent_there(pd) -> None:
    """Once a client named its own server as the producer and the decode replica imported what it served (and
    sent it the daemon's key): now an address the operator did not list is refused before anything is sent."""
    prompt = PD_DOCUMENT + "Q: whose server?"
    with socket.socket() as spy:
        spy.bind(("127.0.0.1", 0))
        spy.listen()
        spy.setblocking(False)
        params = {**prefill_leg(pd, prompt), "remote_port": spy.getsockname()[1]}
        reply = decode_leg(pd, prompt, params)
        assert_refused(reply, 400, "kv_transfer_params", "not a prefill replica this replica fetches from")
        sglang = pd_completion(prompt, bootstrap_host="127.0.0.1", bootstrap_port=spy.getsockname()[1],
                               bootstrap_room=99)
        reply = httpx.post(pd["consumer"].url + "/v1/completions", json=sglang, headers=ACME, timeout=PATIENCE)
        assert_refused(reply, 400, "kv_transfer_params", "not a prefill replica")
        with pytest.raises(BlockingIOError):
            spy.accept()  # nobody connected


def test_zeroed_kv_from_an_impostor_at_a_listed_address_is_never_imported(pd) -> None:
    """Another process at a producer's address replays a real hand-over with every payload zeroed and every
    checksum made again (what poisoned a decode replica's cache for everyone): it cannot prove its answers
    with the fleet's secret, so nothing is imported, and the prompt gives what it gives served whole, to
    the decode leg and to everyone after it."""
    prompt = PD_DOCUMENT + "Q: zeroed?"
    want = cold_text(pd, prompt)
    params = prefill_leg(pd, prompt)
    impostor = pd["impostor"]
    impostor.handovers[params["remote_request_id"]] = HandOver("zeroed", pd["handovers"] / params["remote_request_id"])
    before, got_before = fell_back(pd, "unauthenticated"), received_bytes(pd)
    reply = decode_leg(pd, prompt, {**params, "remote_port": impostor.port})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want
    assert fell_back(pd, "unauthenticated") == before + 1 and received_bytes(pd) == got_before
    served = impostor.handovers[params["remote_request_id"]].served
    assert served.manifests == 1 and served.files_requests == 0  # refused at the manifest's proof
    for headers in (ACME, GLOBEX):
        again = httpx.post(pd["consumer"].url + "/v1/completions", json=pd_completion(prompt), headers=headers,
                           timeout=PATIENCE)
        assert again.json()["choices"][0]["text"] == cold_text(pd, prompt, headers)


def test_a_hand_over_made_for_one_tenant_is_not_imported_for_another(pd) -> None:
    """Acme's prefill leg, then a decode leg presented with globex's key: the hand-over is acme's chain, not
    globex's, so none of it enters globex's scope (once one tenant's blocks could be written under another's
    root); globex's prompt is computed, and what it gets is its cold text."""
    prompt = PD_DOCUMENT + "Q: whose scope?"
    params = prefill_leg(pd, prompt, ACME)
    before, got_before = fell_back(pd, "unverified"), received_bytes(pd)
    reply = decode_leg(pd, prompt, params, GLOBEX)
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == cold_text(pd, prompt, GLOBEX)
    assert fell_back(pd, "unverified") == before + 1 and received_bytes(pd) == got_before
    # Not its own, so not its to release: the hand-over is still there for the request it was made for.
    target = PATH + params["remote_request_id"]
    assert httpx.get(pd["producer"].url + target, headers=proven("GET", target), timeout=PATIENCE).status_code == 200
    mine = decode_leg(pd, prompt, params, ACME)
    assert mine.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == mine.json()["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize("mode", ["endless", "negative_size"])
def test_a_listed_producers_endless_or_negative_manifest_is_read_only_to_its_bound(pd, mode: str) -> None:
    """A manifest that never ends was read whole (1.5 GB took the engine to 7.6 GB); an entry of size -1 asked
    for an endless body. Now a manifest is read up to what this prompt's could be, sizes are checked before
    any file is asked for: a fallback, the prompt computed, the innocent client served meanwhile."""
    prompt = PD_DOCUMENT + f"Q: {mode}?"
    want = cold_text(pd, prompt)
    params = prefill_leg(pd, prompt)
    forger, handover = pd["forger"], HandOver(mode, pd["handovers"] / params["remote_request_id"])
    forger.handovers[params["remote_request_id"]] = handover
    reason = "unverified" if mode == "endless" else "corrupt"
    before = fell_back(pd, reason)
    with Beside(pd["consumer"].url, consumer_greedy(pd), headers=ACME):
        reply = decode_leg(pd, prompt, {**params, "remote_port": forger.port})
    assert reply.status_code == 200 and reply.json()["choices"][0]["text"] == want
    assert fell_back(pd, reason) == before + 1
    assert handover.served.files_requests == 0
    assert handover.served.bytes_sent < 64 << 20  # what the sockets' buffers took, not what it had to send


def test_dripped_manifests_end_at_the_fetch_deadline_and_turn_no_one_away(pd) -> None:
    """Sixteen decode legs whose producer drips its manifest a byte at a time, forever, into a decode replica
    with --max-waiting 16: each fetch ends at its deadline (3 s from arrival, on the socket), its prompt is
    computed, and plain requests beside them are never refused as overloaded (they were, for ~45 s)."""
    forger = pd["forger"]
    prompts = [PD_DOCUMENT + f"Q: drip {i}?" for i in range(16)]
    legs = []
    for prompt in prompts:
        params = prefill_leg(pd, prompt)
        forger.handovers[params["remote_request_id"]] = HandOver("drip")
        legs.append((prompt, {**params, "remote_port": forger.port}))
    wants = [cold_text(pd, p) for p in prompts]
    before = fell_back(pd, "timeout")
    greedy = consumer_greedy(pd)
    replies: list[httpx.Response] = []
    with Beside(pd["consumer"].url, greedy, headers=ACME):
        threads = [threading.Thread(target=lambda p=p, q=q: replies.append(decode_leg(pd, p, q))) for p, q in legs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(PATIENCE)
    assert sorted(r.json()["choices"][0]["text"] for r in replies) == sorted(wants)
    assert fell_back(pd, "timeout") == before + 16


def test_a_listed_producer_that_closes_its_connection_after_each_answer_is_still_fetched_from(pd) -> None:
    """A producer (or a proxy before it) that answers `Connection: close`: the files are asked for on a new
    connection, proven as the first was, and the hand-over is imported whole (an independent producer: the
    hostile one, replaying a real hand-over's files unchanged)."""
    prompt = PD_DOCUMENT + "Q: a new connection each time?"
    params = prefill_leg(pd, prompt)
    forger = pd["forger"]
    handover = HandOver("replay", pd["handovers"] / params["remote_request_id"])
    forger.handovers[params["remote_request_id"]] = handover
    got_before = received_bytes(pd)
    reply = decode_leg(pd, prompt, {**params, "remote_port": forger.port})
    usage = reply.json()["usage"]
    assert reply.json()["choices"][0]["text"] == cold_text(pd, prompt)
    assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
    assert handover.served.files_requests == 1 and received_bytes(pd) > got_before


def test_a_decode_leg_that_goes_frees_its_fetch_at_once(tmp_path: Path, pd) -> None:
    """A decode replica with one fetch thread and a minute for each fetch: a leg whose producer drips and whose
    client then leaves held the thread for the whole minute, and the next hand-over waited behind it. Now the
    abandoned fetch's socket is shut, and the next one is fetched at once."""
    forger, port = pd["forger"], int(pd["producer"].url.rsplit(":", 1)[1])
    config = json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {
        "fetch_timeout": 60, "max_fetches": 1, "producers": [f"127.0.0.1:{p}" for p in (port, forger.port)]}})
    consumer = start_daemon("--kv-store-dir", str(tmp_path / "d"), "--kv-transfer-config", config,
                            "--api-keys-file", str(pd["handovers"].parents[1] / "keys"), env=PEER)
    try:
        dripped = PD_DOCUMENT + "Q: left while dripping?"
        params = prefill_leg(pd, dripped)
        forger.handovers[params["remote_request_id"]] = HandOver("drip")
        served = forger.handovers[params["remote_request_id"]].served
        with pytest.raises(httpx.ReadTimeout):  # the client leaves while its fetch is dripped
            httpx.post(consumer.url + "/v1/completions", headers=ACME, timeout=2.0,
                       json=pd_completion(dripped, kv_transfer_params={**params, "remote_port": forger.port}))
        wait_until(lambda: served.closed_by_peer, "the abandoned fetch's connection shut")
        prompt = PD_DOCUMENT + "Q: after one that left?"
        reply = httpx.post(consumer.url + "/v1/completions", headers=ACME, timeout=PATIENCE,
                           json=pd_completion(prompt, kv_transfer_params=prefill_leg(pd, prompt)))
        usage = reply.json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] == usage["prompt_tokens"] - 1
        assert metric(consumer.url, "v4serve_kv_transfer_fallbacks_total") == 0
    finally:
        consumer.stop()


def test_a_manifest_for_a_hand_over_nobody_prefills_is_not_waited_for(tmp_path: Path, monkeypatch) -> None:
    """SGLang's decode leg asks for its room's manifest and waits while the prefill leg runs; a room this
    producer never took a prefill leg for (a client naming any number) held that wait, and its fetch thread,
    for most of fetch_timeout. Now such a request is answered once the grace is over; a known room is
    waited for as before."""
    import asyncio

    from v4serve.cache.kv_transfer import KVTransferConfig
    from v4serve.server import handover as module
    from v4serve.server.errors import ApiError
    from v4serve.server.handover import Handovers

    monkeypatch.setattr(module, "UNKNOWN_GRACE", 0.05)
    config = KVTransferConfig(kv_role="kv_producer", peer_secret="s" * 32, fetch_timeout=PATIENCE)
    handovers = Handovers(config, tmp_path, "127.0.0.1", 8001)
    unknown, known = "a" * 32, "b" * 32

    async def make_later() -> None:
        await asyncio.sleep(0.2)
        (tmp_path / "handover" / known).mkdir(parents=True)
        (tmp_path / "handover" / known / "manifest.json").write_text('{"files": [], "complete": true}')

    async def run() -> None:
        with pytest.raises(ApiError) as refused:
            await asyncio.wait_for(handovers.manifest_when_made(unknown, PATIENCE, "n" * 32), PATIENCE / 2)
        assert refused.value.status == 404
        handovers.pending.add(known)
        maker = asyncio.ensure_future(make_later())
        reply = await asyncio.wait_for(handovers.manifest_when_made(known, PATIENCE, "n" * 32), PATIENCE / 2)
        await maker
        assert json.loads(reply.body) == {"files": [], "complete": True} and not handovers.pending.known(known)

    asyncio.run(run())


def test_a_files_request_without_a_proof_is_refused_before_its_body_is_read(pd) -> None:
    """The files request's proof carries its body's digest, so a request without one is refused before any
    of its body is read (clients without a key could make a producer hold a 4 MB body each)."""
    host, port = pd["producer"].url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(f"POST {PATH}{'5' * 32}/files HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     "Content-Length: 4000000\r\n\r\n".encode())  # and never the body
        sock.settimeout(PATIENCE)
        assert sock.recv(4096).startswith(b"HTTP/1.1 401 ")


def proven(method: str, target: str, body: bytes = b"") -> dict[str, str]:
    return {PEER_HEADER: request_proof(PEER["V4SERVE_KV_PEER_SECRET"].encode(), method, target, body)[0]}


def test_the_hand_over_endpoints_answer_only_peers_and_bound_what_they_are_asked(pd) -> None:
    """Without the fleet's proof: 401 (a keyless producer once served anyone). With it: each name once (one
    name 20,000 times opened it 20,000 times), at least one (`[]` deleted someone's hand-over), a body that
    nests or runs on is a 400 (was a 500), a proof used twice is refused, and only DELETE releases."""
    url = pd["producer"].url
    params = prefill_leg(pd, PD_DOCUMENT + "Q: endpoints?")
    target = PATH + params["remote_request_id"]
    manifest = httpx.get(url + target, headers=proven("GET", target), timeout=PATIENCE)
    assert manifest.status_code == 200
    name = manifest.json()["files"][0]["name"]
    files = target + "/files"

    def post(body: bytes, headers: dict[str, str] | None = None) -> httpx.Response:
        return httpx.post(url + files, content=body, headers=proven("POST", files, body) if headers is None
                          else headers, timeout=PATIENCE)

    for method in ("GET", "DELETE"):
        assert httpx.request(method, url + target, timeout=PATIENCE).status_code == 401
    assert post(b'{"names": []}', {}).status_code == 401
    for body, says in [(json.dumps({"names": [name] * 20_000}).encode(), "each file once"),
                       (b'{"names": []}', "one or more files"),
                       (b'{"names": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", '{"names": [...]}'),
                       (json.dumps({"names": [f"{i:064x}.blk" for i in range(50_000)]}).encode(), "one or more")]:
        reply = post(body)
        assert reply.status_code == 400 and says in reply.json()["error"]["message"], reply.text[:300]
    assert post(b'{"names": ["' + b"a" * (17 << 20) + b'"]}').status_code == 413  # --max-request-bytes
    headers = proven("GET", target)
    assert httpx.get(url + target, headers=headers, timeout=PATIENCE).status_code == 200  # `[]` deleted nothing
    assert httpx.get(url + target, headers=headers, timeout=PATIENCE).status_code == 401  # a replayed proof
    assert httpx.delete(url + target, headers=proven("DELETE", target), timeout=PATIENCE).status_code == 200
    assert httpx.get(url + target, headers=proven("GET", target), timeout=PATIENCE).status_code == 404
    # A replica that is no producer answers at once, whatever wait it is asked for (it waited it out).
    waiting = PATH + "4" * 32 + "?wait=100000"
    reply = httpx.get(pd["consumer"].url + waiting, headers=proven("GET", waiting), timeout=PATIENCE)
    assert reply.status_code == 404 and "hands no KV over" in reply.text


def open_handover_files(pid: int, folder: Path) -> int:
    count = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        with contextlib.suppress(OSError):
            count += os.readlink(fd).startswith(str(folder))
    return count


def test_an_unread_files_reply_holds_one_file_open_and_none_once_its_reader_goes(pd) -> None:
    """A files request whose reader never reads pinned every file it named open, and kept them after it left,
    until a later garbage collection: now the producer opens them one at a time as it sends them (at most
    one is open while it waits on the reader), and none is open once the reader goes."""
    prompt = "".join(f"[{i}] a long document's line, handed over and never read. " for i in range(540))
    params = prefill_leg(pd, prompt)
    folder = pd["handovers"] / params["remote_request_id"]
    target = PATH + params["remote_request_id"]
    names = [e["name"] for e in httpx.get(pd["producer"].url + target, headers=proven("GET", target),
                                          timeout=PATIENCE).json()["files"]]
    send_buffer = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    assert sum((folder / n).stat().st_size for n in names) > send_buffer + (2 << 20)  # more than buffers hold
    body = json.dumps({"names": names}).encode()
    files = target + "/files"
    host, port = pd["producer"].url.removeprefix("http://").split(":")
    pid = pd["producer"].proc.pid
    sent = metric(pd["producer"].url, "v4serve_kv_transfer_sent_bytes_total")
    whole = metric(pd["producer"].url, "v4serve_kv_transfer_sent_requests_total")  # files replies sent in full
    reader = socket.socket()
    reader.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    reader.connect((host, int(port)))
    head = "".join(f"{k}: {v}\r\n" for k, v in proven("POST", files, body).items())
    reader.sendall(f"POST {files} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: "
                   f"{len(body)}\r\n{head}\r\n".encode() + body)
    try:
        wait_until(lambda: metric(pd["producer"].url, "v4serve_kv_transfer_sent_bytes_total") > sent + (1 << 20),
                   "the producer sending")
        for _ in range(20):  # sending, then blocked on the unread socket: at most the file it is on is open
            assert open_handover_files(pid, folder) <= 1
            time.sleep(0.05)
        assert metric(pd["producer"].url, "v4serve_kv_transfer_sent_requests_total") == whole  # not all sent yet
    finally:
        reader.close()
    wait_until(lambda: open_handover_files(pid, folder) == 0, "every file closed once the reader left")


# ---- the keys file: never blocking, never half-read -----------------------------------------------------------------
def keyed_daemon(tmp_path: Path) -> tuple[Path, Daemon, Path, Any]:
    """(its keys file, holding KEYS[0] for acme; the daemon; its log; the status a key's request gets)."""
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS[0]} acme\n")
    served = start_daemon("--api-keys-file", str(keys))

    def status(key: str) -> int:
        return httpx.post(served.url + "/v1/completions", json=GREEDY, headers={"Authorization": f"Bearer {key}"},
                          timeout=PATIENCE).status_code

    return keys, served, Path(served.log.name), status


def test_a_fifo_at_the_keys_file_path_blocks_nothing_and_later_files_still_apply(tmp_path: Path) -> None:
    """A FIFO put where the keys file was held the watcher in open() forever: later replacements never applied
    (a revoked key kept working) and SIGTERM hung for minutes. Now it is refused as no regular file (the keys in
    force kept), the next real file applies, and the daemon stops at once."""
    keys, served, log, status = keyed_daemon(tmp_path)
    try:
        fifo = tmp_path / "fifo"
        os.mkfifo(fifo)
        fifo.replace(keys)
        wait_until(lambda: "is not a regular file" in log.read_text(errors="replace"), "the FIFO refused")
        assert status(KEYS[0]) == 200  # the keys in force stay
        write_file(keys, f"{KEYS[1]} globex\n".encode())  # KEYS[0] revoked, KEYS[1] new
        wait_until(lambda: status(KEYS[1]) == 200, "the next keys file applied")
        assert status(KEYS[0]) == 401
        fifo = tmp_path / "fifo2"
        os.mkfifo(fifo)
        fifo.replace(keys)  # a FIFO again, as the daemon stops
        wait_until(lambda: log.read_text(errors="replace").count("is not a regular file") >= 2, "the FIFO refused")
    finally:
        code = served.stop(signal.SIGTERM)
    assert code == 0  # a clean stop, not the kill that follows an overstay


def test_a_keys_file_caught_mid_write_is_not_read_until_whole(tmp_path: Path) -> None:
    """`sk-globex-1 glob` on disk for a moment (a write caught halfway) ran that key's requests as tenant `glob`:
    another cache scope, and a prefix of a tenant's name would share its cache. A file whose last line has no
    newline is now read only once it has stayed unchanged for a while; once the write ends with its newline it
    applies at once, as the tenant it names."""
    keys, served, log, status = keyed_daemon(tmp_path)
    try:
        with open(keys, "ab") as file:  # appended in place, in two writes, as an editor or a script might
            file.write(f"{KEYS[1]} glob".encode())
            file.flush()
            wait_until(lambda: "ends inside a line" in log.read_text(errors="replace"), "the torn write noticed")
            assert status(KEYS[1]) == 401 and status(KEYS[0]) == 200  # the torn line is not in force
            file.write(b"ex\n")
        wait_until(lambda: status(KEYS[1]) == 200, "the whole file read")
        text = httpx.get(served.url + "/metrics", timeout=PATIENCE).text
        assert 'tenant="globex"' in text and 'tenant="glob"' not in text
    finally:
        served.stop()


def test_a_torn_keys_file_that_stays_as_it_is_is_read_once_settled(tmp_path: Path, monkeypatch) -> None:
    """A file without a final newline that nobody finishes is the operator's file after all: read once it has
    not changed for SETTLE_SECONDS (here 0.5), not refused for ever."""
    from v4serve.server import tenants

    monkeypatch.setattr(tenants, "SETTLE_SECONDS", 0.5)
    monkeypatch.setattr(tenants, "RECHECK_SECONDS", 0.05)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS[0]} acme\n")
    table = tenants.ApiKeys(keys_file=keys)
    table.watch()
    try:
        keys.write_text(f"{KEYS[0]} acme\n{KEYS[1]} globex")
        wait_until(lambda: table.tenant_of(KEYS[1].encode()) == "globex", "the settled file read")
    finally:
        table.close()


def test_a_keys_file_caught_mid_write_at_start_is_waited_for(tmp_path: Path, monkeypatch) -> None:
    """At start too: a file whose last line is cut is not read as it is (its key would serve tenant `glob`),
    but once its write is done."""
    from v4serve.server import tenants

    monkeypatch.setattr(tenants, "RECHECK_SECONDS", 0.05)
    keys = tmp_path / "keys"
    keys.write_text(f"{KEYS[0]} acme\n{KEYS[1]} glob")

    def finish() -> None:
        time.sleep(0.3)
        with open(keys, "a") as file:
            file.write("ex\n")

    writer = threading.Thread(target=finish)
    writer.start()
    table = tenants.ApiKeys(keys_file=keys)
    writer.join()
    assert table.tenant_of(KEYS[1].encode()) == "globex"


# ---- API servers: one dying ends the others' streams properly --------------------------------------------------------
def test_an_api_server_that_dies_ends_the_other_streams_with_an_error_and_health_says_so() -> None:
    """kill -9 of the second API server: streams on the first were cut without an error event or [DONE], and
    /health said ok for seconds. Now shutdown is decided at once: /health answers 503, and every running
    stream ends with an error event and [DONE] before the daemon exits 1."""
    from tests.test_api_servers import named_children, on_server

    served = start_daemon("--api-server-count", "2", "--shutdown-timeout", "5")
    try:
        first = on_server(served.url, 0)
        body = {**GREEDY, "prompt": "A long story:", "max_tokens": 30_000, "ignore_eos": True, "stream": True}
        with first.stream("POST", "/v1/completions", json=body) as response:
            lines = response.iter_lines()
            assert next(line for line in lines if line.startswith("data: "))
            os.kill(named_children(served.proc.pid)["v4serve-api"][0], signal.SIGKILL)
            health = httpx.Client(base_url=served.url, timeout=PATIENCE)
            wait_until(lambda: on_server_health(health) == 503, "/health to say the daemon is going")
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]" and '"error"' in rest[-2], rest[-3:]
        assert served.proc.wait(timeout=PATIENCE) == 1
    finally:
        served.stop(signal.SIGKILL)


def on_server_health(client: httpx.Client) -> int:
    try:
        return client.get("/health").status_code
    except httpx.TransportError:  # the first API server has stopped listening: past the point tested
        return -1


# ---- headers: bounded in size and number ------------------------------------------------------------------------
def raw_exchange(url: str, request: bytes) -> bytes:
    """Send `request` on a fresh connection and read what comes back until the server closes it."""
    host, port = urlsplit(url).hostname, urlsplit(url).port
    with socket.create_connection((host, port)) as sock:
        with contextlib.suppress(OSError):  # the server may close before the client has sent it all
            sock.sendall(request)
        sock.settimeout(PATIENCE)
        chunks = []
        with contextlib.suppress(OSError):
            while chunk := sock.recv(1 << 16):
                chunks.append(chunk)
        return b"".join(chunks)


@pytest.mark.parametrize(("headers", "says"), [
    (b"X-Big: " + b"a" * (40 << 20) + b"\r\n", "over (65536|4194304) bytes"),  # one 40 MB line got a 200
    (b"".join(b"X-H%d: 1\r\n" % i for i in range(10_000)), "over 256 headers"),  # 10,000 headers got a 200
    (b"".join(b"X-H%d: %s\r\n" % (i, b"b" * 60_000) for i in range(80)), "headers are over 4194304 bytes"),
    (b"X-Long: " + b"d" * 70_000 + b"\r\n", "a header line is over 65536 bytes"),
], ids=["one-huge-line", "ten-thousand", "many-long", "one-long-line"])
def test_headers_past_their_bounds_are_a_431_and_everyone_else_is_served(url: str, greedy_text: str, headers: bytes,
                                                                         says: str) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: x\r\n" + headers + b"\r\n"
    with Beside(url, greedy_text):
        replies = [None] * 8
        threads = [threading.Thread(target=lambda i=i: replies.__setitem__(i, raw_exchange(url, request)))
                   for i in range(8)]  # eight at once took the front end from 375 to 769 MB
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(PATIENCE)
    for reply in replies:
        head, _, body = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 431 ") and b"connection: close" in head.lower(), reply[:200]
        error = json.loads(body)["error"]
        assert error["code"] == "request_header_fields_too_large" and re.search(says, error["message"])
    assert metric(url, "v4serve_connections_closed_total", reason="header_size") >= 8


def test_headers_within_their_bounds_are_served(url: str) -> None:
    """At the bounds, not past them: 255 headers besides Host, a 60 KB line (a large cookie or token)."""
    request = (b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-Long: " + b"c" * 60_000 + b"\r\n"
               + b"".join(b"X-H%d: 1\r\n" % i for i in range(253)) + b"\r\n")
    assert raw_exchange(url, request).startswith(b"HTTP/1.1 200 ")


# ---- a preprocessing worker that dies mid-job ------------------------------------------------------------------------
def dies_once(_tokenizer: Any, marker: str) -> str:
    """A job that kills its own worker the first time it runs (the injected fault), and answers the second."""
    if not Path(marker).exists():
        Path(marker).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return "answered"


def always_dies(_tokenizer: Any) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def test_a_job_whose_worker_dies_runs_again_and_twice_dead_is_a_retryable_503(tmp_path: Path) -> None:
    """A worker killed mid-job (the OOM killer, a kill -9) gave its request a 500. Jobs are pure functions of
    their arguments, so the fresh worker runs it once more; one that kills that worker too is a 503 with
    Retry-After, never a 500, and the pool serves on."""
    import asyncio

    from v4serve.server.errors import ApiError
    from v4serve.server.preprocess import PreprocessConfig, Preprocessor

    pool = Preprocessor(ByteTokenizer(), PreprocessConfig(workers=1, cpu_seconds=30.0))
    pool.start()
    try:
        assert asyncio.run(pool.run(dies_once, str(tmp_path / "marker"))) == "answered"
        with pytest.raises(ApiError) as refused:
            asyncio.run(pool.run(always_dies))
        assert refused.value.status == 503 and refused.value.headers == {"Retry-After": "1"}
        assert refused.value.code == "preprocess_worker_died"
        assert asyncio.run(pool.run(dies_once, str(tmp_path / "marker"))) == "answered"  # served on
        assert pool.replaced == 3
    finally:
        pool.close()
