"""Prefill and decode on separate replicas behind vLLM's router (its PD mode, the pinned Rust binary from
PyPI): one prefill replica and two decode replicas of the tiny model, each with a store of its own, so
every hand-over crosses the network. Each API surface, streamed and not, answers through the router what
one replica answers alone; the transfers are counted on both sides; a decode replica that already holds
part of the prefix fetches only the rest; a hand-over that cannot be fetched is computed, never wrong.
(tests/test_kv_transfer.py checks the hand-over's state below HTTP, in every SWA mode and at boundaries.)"""

from __future__ import annotations

import contextlib
import json
import re
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from tests.daemon import PATIENCE, start_daemon
from tests.routers import SGLANG_ROUTER, VLLM_ROUTER, router
from tests.test_kv_transfer import dead_port
from v4serve.cache.peer_auth import PEER_HEADER, request_proof

DOCUMENT = "a long shared document, read once and asked about many times. " * 12
COMPLETION = {"model": "v4serve-tiny", "prompt": DOCUMENT + "Q: what is it?", "max_tokens": 12, "temperature": 0}
CHAT = {"model": "v4serve-tiny", "messages": [{"role": "user", "content": DOCUMENT + "what is it?"}],
        "max_tokens": 12, "temperature": 0}
LOOKUP = {"type": "function", "function": {"name": "lookup", "parameters": {
    "type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
CHAT_TOOLS = {**CHAT, "max_tokens": 40, "tools": [LOOKUP], "tool_choice": "required"}
CHAT_JSON = {**CHAT, "max_tokens": 40, "response_format": {"type": "json_schema", "json_schema": {
    "name": "o", "schema": {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}}
RESPONSES = {"model": "v4serve-tiny", "input": DOCUMENT + "and then?", "max_output_tokens": 12, "temperature": 0}
MESSAGES = {"model": "v4serve-tiny", "messages": [{"role": "user", "content": DOCUMENT + "why?"}], "max_tokens": 12,
            "temperature": 0}


def series(url: str, name: str, **labels: str) -> float:
    """One sample of a replica's /metrics (0 if absent)."""
    text = httpx.get(url + "/metrics", timeout=PATIENCE).text
    want = [f'{k}="{v}"' for k, v in labels.items()]
    total = 0.0
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(w in (m.group(1) or "") for w in want):
            total += float(m.group(2))
    return total


SECRET = {"V4SERVE_KV_PEER_SECRET": "the-fleets-peer-secret-0123456789"}


@pytest.fixture(scope="module")
def fleet(tmp_path_factory) -> Iterator[dict[str, object]]:
    root = tmp_path_factory.mktemp("pd")
    producer = '{"kv_role": "kv_producer"}'
    # The prefill replica answers requests without transfer params as any replica does: the truth.
    daemons = {"prefill": start_daemon("--kv-store-dir", str(root / "p"), "--kv-transfer-config", producer, env=SECRET)}
    daemons["alone"] = daemons["prefill"]
    port = int(daemons["prefill"].url.rsplit(":", 1)[1])
    proxy, dead = CuttingProxy(port), dead_port()
    # Listed: the prefill replica, a proxy in front of it that cuts replies, and an address nothing answers at.
    consumer = json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {
        "fetch_timeout": PATIENCE, "producers": [f"127.0.0.1:{p}" for p in (port, proxy.port, dead)]}})
    try:
        daemons["decode"] = [start_daemon("--kv-store-dir", str(root / f"d{i}"), "--kv-transfer-config", consumer,
                                          env=SECRET) for i in range(2)]
        with router(VLLM_ROUTER, [], policy="round_robin", extra=[
                "--vllm-pd-disaggregation", "--prefill", daemons["prefill"].url,
                *[a for d in daemons["decode"] for a in ("--decode", d.url)]]) as url:
            yield {**daemons, "router": url, "proxy": proxy, "dead_port": dead}
    finally:
        proxy.close()
        for d in [daemons["prefill"], *daemons.get("decode", [])]:
            if d is not None:
                d.stop()


def received(fleet) -> float:
    return sum(series(d.url, "v4serve_kv_transfer_requests_total", source="network") for d in fleet["decode"])


def fallbacks(fleet) -> float:
    return sum(series(d.url, "v4serve_kv_transfer_fallbacks_total") for d in fleet["decode"])


def text_of(path: str, reply: dict) -> str:
    if path == "/v1/completions":
        return reply["choices"][0]["text"]
    if path == "/v1/chat/completions":
        message = reply["choices"][0]["message"]
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in message.get("tool_calls") or []]
        return (message["content"] or "") + json.dumps(calls)
    if path == "/v1/responses":
        return "".join(c["text"] for item in reply["output"] if item["type"] == "message" for c in item["content"])
    return "".join(b["text"] for b in reply["content"] if b["type"] == "text")


def streamed_text(path: str, lines: list[str]) -> str:
    out, calls = [], {}
    for line in lines:
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[6:])
        if path == "/v1/completions":
            out += [c["text"] for c in event["choices"]]
        elif path == "/v1/chat/completions":
            out += [c["delta"].get("content") or "" for c in event["choices"]]
            for c in event["choices"]:
                for call in c["delta"].get("tool_calls") or []:
                    name, args = calls.get(call["index"], ("", ""))
                    calls[call["index"]] = (name + (call["function"].get("name") or ""),
                                            args + call["function"].get("arguments", ""))
        elif path == "/v1/responses" and event["type"] == "response.output_text.delta":
            out.append(event["delta"])
        elif path == "/v1/messages" and event["type"] == "content_block_delta" and "text" in event["delta"]:
            out.append(event["delta"]["text"])
    if path == "/v1/chat/completions":
        out.append(json.dumps([calls[i] for i in sorted(calls)]))
    return "".join(out)


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT),
                                            ("/v1/chat/completions", CHAT_TOOLS), ("/v1/chat/completions", CHAT_JSON),
                                            ("/v1/responses", RESPONSES), ("/v1/messages", MESSAGES)],
                         ids=["completions", "chat", "chat-tools", "chat-json-schema", "responses", "messages"])
def test_every_surface_through_the_pd_router_answers_what_one_replica_does(fleet, path, body) -> None:
    alone = httpx.post(fleet["alone"].url + path, json=body, timeout=PATIENCE).json()
    handed_before = series(fleet["prefill"].url, "v4serve_kv_transfer_handovers_total", outcome="ok")
    fetched_before, fell_before = received(fleet), fallbacks(fleet)
    assert text_of(path, alone) and ("lookup" in text_of(path, alone) if body is CHAT_TOOLS else True)
    routed = httpx.post(fleet["router"] + path, json=body, timeout=PATIENCE)
    assert routed.status_code == 200, routed.text
    assert text_of(path, routed.json()) == text_of(path, alone)
    with httpx.stream("POST", fleet["router"] + path, json={**body, "stream": True}, timeout=PATIENCE) as stream:
        assert stream.status_code == 200
        lines = list(stream.iter_lines())
    assert streamed_text(path, lines) == text_of(path, alone)
    # Both requests were prefilled on the prefill replica and fetched by a decode replica over TCP.
    assert series(fleet["prefill"].url, "v4serve_kv_transfer_handovers_total", outcome="ok") == handed_before + 2
    assert received(fleet) == fetched_before + 2 and fallbacks(fleet) == fell_before


def test_the_decode_side_hits_all_but_the_last_prompt_token(fleet) -> None:
    """(The router's reply reports the prefill leg's cached tokens: the decode replicas' own counters say
    what they took from the hand-over.)"""
    def hits() -> float:
        return sum(series(d.url, "v4serve_prefix_cache_hits_total") for d in fleet["decode"])

    before = hits()
    routed = httpx.post(fleet["router"] + "/v1/completions", json={**COMPLETION, "prompt": DOCUMENT + "Q: how?"},
                        timeout=PATIENCE).json()
    assert hits() - before == routed["usage"]["prompt_tokens"] - 1


def test_a_decode_replica_holding_part_of_the_prefix_fetches_only_the_rest(fleet) -> None:
    """Sent leg by leg (as the router sends them) to one decode replica, which first served the document's
    first half itself: its fetch brings fewer bytes than the same hand-over to its twin, which holds nothing."""
    first, twin = fleet["decode"]
    prompt = DOCUMENT * 2 + "Q: the second half?"
    httpx.post(first.url + "/v1/completions", json={**COMPLETION, "prompt": DOCUMENT * 2, "max_tokens": 1},
               timeout=PATIENCE).raise_for_status()
    counts = []
    for replica in (first, twin):
        pre = httpx.post(fleet["prefill"].url + "/v1/completions",
                         json={**COMPLETION, "prompt": prompt, "max_tokens": 1, "min_tokens": 1,
                               "kv_transfer_params": {"do_remote_decode": True}}, timeout=PATIENCE).json()
        before = series(replica.url, "v4serve_kv_transfer_received_bytes_total")
        got = httpx.post(replica.url + "/v1/completions", json={**COMPLETION, "prompt": prompt,
                                                                 "kv_transfer_params": pre["kv_transfer_params"]},
                         timeout=PATIENCE).json()
        counts.append(series(replica.url, "v4serve_kv_transfer_received_bytes_total") - before)
        assert got["usage"]["prompt_tokens_details"]["cached_tokens"] == got["usage"]["prompt_tokens"] - 1
    assert 0 < counts[0] < counts[1]


def test_a_hand_over_that_cannot_be_fetched_is_computed(fleet) -> None:
    decode = fleet["decode"][0]
    alone = httpx.post(fleet["alone"].url + "/v1/completions", json=COMPLETION, timeout=PATIENCE).json()
    before = series(decode.url, "v4serve_kv_transfer_fallbacks_total", reason="unreachable")
    params = {"do_remote_prefill": True, "do_remote_decode": False, "remote_host": "127.0.0.1",
              "remote_port": fleet["dead_port"], "remote_request_id": "0" * 32}
    got = httpx.post(decode.url + "/v1/completions", json={**COMPLETION, "kv_transfer_params": params},
                     timeout=PATIENCE)
    assert got.status_code == 200 and got.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert series(decode.url, "v4serve_kv_transfer_fallbacks_total", reason="unreachable") == before + 1
    # A hand-over fetched already (or never made) is refused by the prefill replica: a fallback too.
    gone = {**params, "remote_port": int(fleet["prefill"].url.rsplit(":", 1)[1]), "remote_request_id": "1" * 32}
    got = httpx.post(decode.url + "/v1/completions", json={**COMPLETION, "kv_transfer_params": gone},
                     timeout=PATIENCE)
    assert got.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    assert series(decode.url, "v4serve_kv_transfer_fallbacks_total", reason="refused") >= 1


def test_malformed_transfer_params_or_an_unlisted_producer_are_a_400(fleet) -> None:
    decode = fleet["decode"][0]
    bad = {"do_remote_prefill": True, "remote_host": "127.0.0.1", "remote_port": "80", "remote_request_id": "x"}
    unlisted = {**bad, "remote_port": dead_port(), "remote_request_id": "3" * 32}
    sglang = {"bootstrap_host": "127.0.0.1", "bootstrap_port": dead_port(), "bootstrap_room": 7}
    for body in ({**COMPLETION, "kv_transfer_params": bad}, {**COMPLETION, "kv_transfer_params": unlisted},
                 {**COMPLETION, **sglang}):
        reply = httpx.post(decode.url + "/v1/completions", json=body, timeout=PATIENCE)
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "kv_transfer_params", reply.text
    # The hand-over endpoints answer only the fleet's replicas, and then only a hand-over's own id and files.
    prefill = fleet["prefill"].url
    traversal, absent = "/v4serve/kv_transfer/..%2f..%2fetc", "/v4serve/kv_transfer/" + "2" * 32
    assert httpx.get(prefill + traversal, headers=peer(SECRET, "GET", traversal), timeout=PATIENCE).status_code == 404
    assert httpx.get(prefill + absent, timeout=PATIENCE).status_code == 401
    assert httpx.get(prefill + absent, headers=peer(SECRET, "GET", absent), timeout=PATIENCE).status_code == 404
    target, body = "/v4serve/kv_transfer/" + "2" * 32 + "/files", json.dumps({"names": ["../x"]}).encode()
    assert httpx.post(prefill + target, content=body, timeout=PATIENCE).status_code == 401
    assert httpx.post(prefill + target, content=body, headers=peer(SECRET, "POST", target, body),
                      timeout=PATIENCE).status_code == 404


def peer(secret: dict[str, str], method: str, target: str, body: bytes = b"") -> dict[str, str]:
    """The header a replica holding the fleet's secret proves a request with."""
    return {PEER_HEADER: request_proof(secret["V4SERVE_KV_PEER_SECRET"].encode(), method, target, body)[0]}


class CuttingProxy:
    """A TCP proxy to `target_port` that passes requests whole and then only the first `keep` bytes of
    what comes back (all of it while `keep` is None) before closing both sides: a hand-over cut
    mid-transfer (the injected fault). Listed among the decode replicas' producers."""

    def __init__(self, target_port: int) -> None:
        self.target_port, self.keep = target_port, None
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen()
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target_port))
            threading.Thread(target=self._pipe, args=(client, upstream, None), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, self.keep), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, limit: int | None) -> None:
        passed = 0
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if limit is not None and passed + len(data) > limit:
                    dst.sendall(data[:limit - passed])
                    break
                dst.sendall(data)
                passed += len(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_a_hand_over_cut_mid_transfer_is_computed(fleet) -> None:
    """The files' reply ends 100 KB in (inside a block file): the files before the cut are kept, the rest
    is computed, the output is the one a single replica gives."""
    decode, prefill = fleet["decode"][1], fleet["prefill"].url
    body = {**COMPLETION, "prompt": DOCUMENT * 3 + "Q: cut?"}
    alone = httpx.post(fleet["alone"].url + "/v1/completions", json=body, timeout=PATIENCE).json()
    pre = httpx.post(prefill + "/v1/completions", json={**body, "max_tokens": 1, "min_tokens": 1,
                                                        "kv_transfer_params": {"do_remote_decode": True}},
                     timeout=PATIENCE).json()
    before = series(decode.url, "v4serve_kv_transfer_fallbacks_total")
    proxy = fleet["proxy"]
    proxy.keep = 100_000
    try:
        params = {**pre["kv_transfer_params"], "remote_port": proxy.port}
        got = httpx.post(decode.url + "/v1/completions", json={**body, "kv_transfer_params": params},
                         timeout=PATIENCE).json()
    finally:
        proxy.keep = None
    assert got["choices"][0]["text"] == alone["choices"][0]["text"]
    assert series(decode.url, "v4serve_kv_transfer_fallbacks_total") == before + 1
    cached = got["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached < got["usage"]["prompt_tokens"] - 1


@pytest.mark.parametrize(("path", "body"), [("/v1/completions", COMPLETION), ("/v1/chat/completions", CHAT_TOOLS)],
                         ids=["completions", "chat-tools"])
def test_sglang_routers_pd_mode_gets_what_one_replica_gives(fleet, path, body) -> None:
    """SGLang's router sends both legs at once with a bootstrap room (no Mooncake: the prefill replica's
    HTTP port is its bootstrap port, and the decode replica's fetch waits for the hand-over to be made)."""
    prefill = fleet["prefill"].url
    alone = httpx.post(fleet["alone"].url + path, json=body, timeout=PATIENCE).json()
    decode_args = [a for d in fleet["decode"] for a in ("--decode", d.url)]
    with router(SGLANG_ROUTER, [], policy="round_robin", extra=[
            "--pd-disaggregation", "--prefill", prefill, prefill.rsplit(":", 1)[1], *decode_args]) as url:
        handed_before = series(prefill, "v4serve_kv_transfer_handovers_total", outcome="ok")
        fetched_before, fell_before = received(fleet), fallbacks(fleet)
        routed = httpx.post(url + path, json=body, timeout=PATIENCE)
        assert routed.status_code == 200, routed.text
        assert text_of(path, routed.json()) == text_of(path, alone)
        with httpx.stream("POST", url + path, json={**body, "stream": True}, timeout=PATIENCE) as stream:
            lines = list(stream.iter_lines())
        assert streamed_text(path, lines) == text_of(path, alone)
    assert series(prefill, "v4serve_kv_transfer_handovers_total", outcome="ok") == handed_before + 2
    assert received(fleet) == fetched_before + 2 and fallbacks(fleet) == fell_before


def test_sglangs_prefill_leg_with_min_tokens_answers_its_one_token(fleet) -> None:
    """The router sends the client's body to both legs: a `min_tokens` above the prefill leg's one
    token is the decode leg's to honour, not a 400 on the prefill leg (it was)."""
    prefill = fleet["prefill"].url
    host, port = prefill.rsplit("//", 1)[1].rsplit(":", 1)
    body = {**COMPLETION, "prompt": DOCUMENT + "Q: how many?", "min_tokens": 4, "bootstrap_host": host,
            "bootstrap_port": int(port), "bootstrap_room": 4242}
    handed_before = series(prefill, "v4serve_kv_transfer_handovers_total", outcome="ok")
    reply = httpx.post(prefill + "/v1/completions", json=body, timeout=PATIENCE)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["completion_tokens"] == 1
    assert series(prefill, "v4serve_kv_transfer_handovers_total", outcome="ok") == handed_before + 1
    too_many = httpx.post(prefill + "/v1/completions", json={**COMPLETION, "min_tokens": 13}, timeout=PATIENCE)
    assert too_many.status_code == 400 and "min_tokens" in too_many.text  # a client's own request: still checked
