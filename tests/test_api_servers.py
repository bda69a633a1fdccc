"""Several API-server processes over one engine (`--api-server-count`, server/api_servers.py): the real
daemon with two, reached over real HTTP; which process took a connection is read from /version on
that connection."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon import PATIENCE, start_daemon, wait_until
from v4serve.server.errors import ApiError
from v4serve.server.responses import SharedStoredResponses, StoredResponse
from v4serve.server.serve import ServeConfig

COMPLETIONS, CHAT, RESPONSES = "/v1/completions", "/v1/chat/completions", "/v1/responses"
TRIES = 400  # fresh connections tried to meet a given API server; each lands on one of two


def children(pid: int) -> dict[str, list[int]]:
    """The processes `pid` started, by their kernel name."""
    found: dict[str, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                comm = (entry / "comm").read_text().strip()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.setdefault(comm, []).append(int(entry.name))
    return found


def named_children(pid: int) -> dict[str, list[int]]:
    """Once the second API server has named itself."""
    wait_until(lambda: "v4serve-api" in children(pid), "the second API server to start")
    return children(pid)


def on_server(url: str, index: int) -> httpx.Client:
    """A client whose connection API server `index` took (it keeps that connection)."""
    for _ in range(TRIES):
        client = httpx.Client(base_url=url, timeout=PATIENCE)
        if client.get("/version").json()["api_server"] == index:
            return client
        client.close()
    raise AssertionError(f"{TRIES} new connections and none reached API server {index}")


def metric(text: str, name: str) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith(name + "{"))


def test_two_api_servers_share_the_port_the_engine_the_metrics_and_the_stored_responses(tmp_path) -> None:
    running = start_daemon("--api-server-count", "2", "--shutdown-timeout", "6", "--max-num-seqs", "8",
                           env={"TMPDIR": str(tmp_path)})  # where its private folders go
    try:
        processes = named_children(running.proc.pid)
        assert len(processes["v4serve-api"]) == 1 and len(processes["v4serve-engine"]) == 1
        clients = [on_server(running.url, 0), on_server(running.url, 1)]
        assert [c.get("/version").json()["api_server_count"] for c in clients] == [2, 2]

        # Each prompt's greedy text is the same streamed through one process and whole through the
        # other: outputs go back to the process that took the request, never to the other one.
        made = 0
        for i in range(4):
            body = {"model": "v4serve-tiny", "prompt": f"prompt {i} " * (5 + i), "max_tokens": 12, "ignore_eos": True,
                    "temperature": 0}
            whole = clients[i % 2].post(COMPLETIONS, json=body).json()
            with clients[1 - i % 2].stream("POST", COMPLETIONS, json={**body, "stream": True}) as resp:
                events = [json.loads(line[6:]) for line in resp.iter_lines()
                          if line.startswith("data: ") and line != "data: [DONE]"]
            assert "".join(e["choices"][0]["text"] for e in events) == whole["choices"][0]["text"]
            made += 2 * whole["usage"]["completion_tokens"]
        chat = {"model": "v4serve-tiny", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 6,
                "temperature": 0}
        answers = [c.post(CHAT, json=chat).json() for c in clients]
        assert answers[0]["choices"][0]["message"] == answers[1]["choices"][0]["message"]
        made += sum(a["usage"]["completion_tokens"] for a in answers)

        # Either process answers /metrics for both.
        scrapes = [c.get("/metrics").text for c in clients]
        for text in scrapes:
            assert metric(text, "v4serve_generation_tokens_total") == made
            assert metric(text, "v4serve_request_success_total") == 10
            assert metric(text, "v4serve_time_to_first_token_seconds_count") == 10
            assert "v4serve_requests_running{" in text  # the engine's snapshot beside them

        # A stored response is continued, read and deleted from either process.
        first = clients[0].post(RESPONSES, json={"model": "v4serve-tiny", "input": "a question " * 8,
                                                 "max_output_tokens": 4}).json()
        for client in clients:
            follow = client.post(RESPONSES, json={"model": "v4serve-tiny", "input": "and?", "max_output_tokens": 4,
                                                  "previous_response_id": first["id"]})
            assert follow.status_code == 200
            assert follow.json()["usage"]["input_tokens_details"]["cached_tokens"] > 0
            assert client.get(f"{RESPONSES}/{first['id']}").json()["id"] == first["id"]
        assert clients[1].delete(f"{RESPONSES}/{first['id']}").status_code == 200
        assert [c.get(f"{RESPONSES}/{first['id']}").status_code for c in clients] == [404, 404]
        for client in clients:
            client.close()

        # SIGTERM: endless streams on both processes end with an error event and [DONE]; everything exits 0.
        ended: list[list[str]] = [[], [], [], []]
        started = threading.Barrier(5, timeout=PATIENCE)

        def stream(i: int) -> None:
            client = on_server(running.url, i % 2)
            body = {"model": "v4serve-tiny", "prompt": f"endless {i}", "max_tokens": 20000, "ignore_eos": True,
                    "stream": True}
            try:
                with client.stream("POST", COMPLETIONS, json=body) as resp:
                    lines = resp.iter_lines()
                    ended[i].append(next(line for line in lines if line.startswith("data: ")))
                    started.wait()
                    ended[i] += [line for line in lines if line.startswith("data: ")]
            finally:
                client.close()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        started.wait()
        assert sorted(p.name[:12] for p in tmp_path.glob("v4serve-*")) == ["v4serve-api-", "v4serve-ipc-"]
        assert running.stop(signal.SIGTERM) == 0
        for t in threads:
            t.join(timeout=PATIENCE)
        for lines in ended:
            assert lines[-1] == "data: [DONE]"
            assert "shutting down" in json.loads(lines[-2][6:])["error"]["message"]
        for pid in processes["v4serve-api"] + processes["v4serve-engine"]:
            wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists(), f"process {pid} to exit")
        assert not list(tmp_path.glob("v4serve-*"))  # the shared and the engine's folders are removed
    finally:
        running.stop(signal.SIGKILL)


def test_an_api_server_that_dies_stops_the_daemon_with_an_error() -> None:
    """kill -9 of the second API server (a crash, the OOM killer): the daemon exits non-zero, saying
    why, and takes the engine with it, so a service manager restarts the whole."""
    running = start_daemon("--api-server-count", "2")
    try:
        processes = named_children(running.proc.pid)
        os.kill(processes["v4serve-api"][0], signal.SIGKILL)
        running.proc.wait(timeout=PATIENCE)
        assert running.proc.returncode == 1
        wait_until(lambda: not Path(f"/proc/{processes['v4serve-engine'][0]}").exists(), "the engine to exit")
        log = Path(running.log.name).read_text()
        assert "API server v4serve-api-1" in log and "killed by SIGKILL" in log
    finally:
        running.stop(signal.SIGKILL)


@pytest.mark.parametrize(("settings", "message"), [
    ({"api_server_count": 0}, "--api-server-count must be at least 1"),
    ({"api_server_count": 2, "engine_in_process": True}, "cannot be combined with --api-server-count"),
])
def test_api_server_count_settings_that_cannot_work_are_refused(settings: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ServeConfig(**settings).check_http_settings()


def _stored(owner: str, words: int) -> StoredResponse:
    return StoredResponse({"id": "x", "output": ["word " * words]}, owner, [{"role": "user", "content": "hi"}], ())


def test_stored_responses_are_shared_through_the_folder(tmp_path) -> None:
    """Two processes' stores over one folder (as two API servers): each finds the other's, owners are
    checked, a delete anywhere is seen everywhere, and each bounds what it stored itself."""
    one, two = SharedStoredResponses(tmp_path, 2, max_bytes=4000), SharedStoredResponses(tmp_path, 2, max_bytes=4000)
    ids = [f"resp_{i:032x}" for i in range(4)]
    one.put(ids[0], _stored("alice", 10))
    assert two.get(ids[0], "alice").messages == [{"role": "user", "content": "hi"}]
    with pytest.raises(ApiError, match="No response found") as refused:
        two.get(ids[0], "bob")
    assert refused.value.status == 404
    two.delete(ids[0], "alice")
    for store in (one, two):
        with pytest.raises(ApiError, match="No response found"):
            store.get(ids[0], "alice")
    # 2,000 bytes each (its half): a third ~900-byte response of one's drops its first, file and all.
    for rid in ids[1:]:
        one.put(rid, _stored("alice", 180))
    assert sorted(p.name for p in tmp_path.iterdir()) == ids[2:]
    for bad in ("../x", "resp_" + "0" * 31, ids[1] + "/"):
        with pytest.raises(ApiError, match="No response found"):
            two.get(bad, "alice")
