"""Faults around the daemon: a dying engine (injected into the engine process), a full waiting
queue, n > 1 sharing the prompt's blocks, and resetting the SSD store over HTTP."""

from __future__ import annotations

import json
import threading

import httpx

from tests.daemon import PATIENCE, daemon, in_process_server, wait_until
from tests.helpers import tokens
from v4serve.server.serve import ServeConfig


def stream_lines(url: str, body: dict) -> list[str]:
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=PATIENCE) as resp:
        assert resp.status_code == 200
        return [line for line in resp.iter_lines() if line.startswith("data: ")]


def test_one_failed_forward_fails_its_step_and_the_engine_serves_on():
    cfg = ServeConfig(no_kv_store=True, max_num_seqs=2, engine_hook="tests.faults:fail_fourth_forward")
    with in_process_server(cfg) as (url, _):
        lines = stream_lines(url, {"prompt": [70, 71, 72], "max_tokens": 50, "ignore_eos": True})
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])
        # The fault's kind, never its text (it stays in the engine's log: it can hold anything).
        assert "the forward pass failed (RuntimeError" in error["error"]["message"]
        assert "injected device fault" not in json.dumps(error)
        assert error["error"]["code"] == "generation_failed"
        assert httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
        after = httpx.post(url + "/v1/completions", json={"prompt": [70], "max_tokens": 2}, timeout=PATIENCE)
        assert after.status_code == 200 and after.json()["usage"]["completion_tokens"] == 2


def test_a_forward_that_keeps_failing_marks_the_engine_dead():
    cfg = ServeConfig(no_kv_store=True, max_num_seqs=2, engine_hook="tests.faults:fail_forwards_after_third")
    with in_process_server(cfg) as (url, engine):
        assert healthy_gauge(url) == 1
        for _ in range(3):  # each request's step fails; the third failure in a row is fatal
            lines = stream_lines(url, {"prompt": [70, 71, 72], "max_tokens": 50, "ignore_eos": True})
            assert lines[-1] == "data: [DONE]"
            message = json.loads(lines[-2][6:])["error"]["message"]
            assert "the forward pass failed" in message and "(RuntimeError; the engine's log has the detail)" in message
            assert not any("injected device fault" in line for line in lines)
        # The engine process sends the failed step's outputs, then word of its death: a client can
        # read the first before this process has had the second.
        wait_until(lambda: engine.unavailable_reason() is not None, "the engine's death to reach the front end")
        health = httpx.get(url + "/health", timeout=PATIENCE)
        assert health.status_code == 503 and health.json()["error"]["code"] == "engine_dead"
        assert healthy_gauge(url) == 0  # /metrics still answers: the gauge is what alerts on it
        assert "3 times in a row" in health.json()["error"]["message"]
        assert "injected device fault" not in health.text  # /health is unauthenticated
        after = httpx.post(url + "/v1/completions", json={"prompt": [70], "max_tokens": 2}, timeout=PATIENCE)
        assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"
        reset = httpx.post(url + "/reset_prefix_cache", timeout=PATIENCE)  # never hangs on a dead loop
        assert reset.status_code == 503 and reset.json()["error"]["code"] == "engine_dead"


def healthy_gauge(url: str) -> float:
    lines = httpx.get(url + "/metrics", timeout=PATIENCE).text.splitlines()
    return float(next(line for line in lines if line.startswith("v4serve_engine_healthy{")).rsplit(" ", 1)[1])


def gauge(url: str, name: str) -> float | None:
    for line in httpx.get(url + "/metrics", timeout=PATIENCE).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def wait_for_gauge(url: str, name: str, value: float) -> None:
    wait_until(lambda: gauge(url, name) == value, f"{name} to reach {value}")


def test_full_waiting_queue_answers_503_with_retry_after():
    with daemon("--max-num-seqs", "1", "--max-waiting", "1") as url:
        long = {"prompt": [70] * 8, "max_tokens": 4000, "ignore_eos": True, "stream": True}
        release = threading.Event()
        statuses: list[int] = []

        def occupy() -> None:
            with httpx.stream("POST", url + "/v1/completions", json=long, timeout=PATIENCE) as resp:
                statuses.append(resp.status_code)
                for _ in resp.iter_lines():
                    if release.is_set():
                        break  # disconnect: the request is aborted

        clients = [threading.Thread(target=occupy) for _ in range(2)]
        clients[0].start()
        wait_for_gauge(url, "v4serve_requests_running", 1)  # the only slot is taken
        clients[1].start()
        wait_for_gauge(url, "v4serve_requests_waiting", 1)  # the queue is full
        refused = httpx.post(url + "/v1/completions", json={"prompt": [70], "max_tokens": 2}, timeout=PATIENCE)
        release.set()
        for c in clients:
            c.join(timeout=PATIENCE)
        assert statuses == [200, 200]
        assert refused.status_code == 503, refused.text
        assert refused.headers.get("retry-after") == "1"
        assert refused.json()["error"]["code"] == "server_overloaded"
        ok = httpx.post(url + "/v1/completions", json={"prompt": [70], "max_tokens": 2}, timeout=PATIENCE)
        assert ok.status_code == 200  # serving resumes once the queue drains


def test_n_choices_share_the_prompt_blocks():
    with in_process_server(ServeConfig(no_kv_store=True, max_num_seqs=4)) as (url, engine):
        prompt = tokens(400, 31)
        reply = httpx.post(url + "/v1/completions", json={"prompt": prompt, "n": 3, "max_tokens": 5,
                                                          "temperature": 0, "ignore_eos": True},
                           timeout=PATIENCE).json()
        texts = {c["text"] for c in reply["choices"]}
        assert len(reply["choices"]) == 3 and len(texts) == 1  # greedy: identical choices
        assert engine.stats.prefix_hits_device == 2 * 384  # the second and third choice reuse the first's 3 blocks


def test_reset_prefix_cache_with_store_empties_the_store(tmp_path):
    with daemon("--kv-store-dir", str(tmp_path)) as url:
        prompt = tokens(300, 32)
        httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=PATIENCE)
        wait_until(lambda: list(tmp_path.rglob("*.blk")), "the store to write a block")  # in the background
        kept = httpx.post(url + "/reset_prefix_cache", timeout=PATIENCE).json()
        assert kept["store_cleared"] is False and list(tmp_path.rglob("*.blk"))
        cleared = httpx.post(url + "/reset_prefix_cache?store=true", timeout=PATIENCE).json()
        assert cleared["store_cleared"] is True
        assert not list(tmp_path.rglob("*.blk"))
        again = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 2}, timeout=PATIENCE).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
