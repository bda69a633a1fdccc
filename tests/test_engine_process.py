"""The engine core in its own process: killing it, stopping the daemon, losing the front end, and
failing to start all end cleanly — an error or a 503 with the cause, an exit, no orphan process."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.daemon import PATIENCE, ROOT, Daemon, start_daemon, wait_until
from v4serve.engine.process import core
from v4serve.engine.process.core_client import EngineCoreClient, EngineStartupError
from v4serve.engine.process.ipc import PROCESS_NAME

ENDLESS = {"prompt": "a stream that outlives its engine", "max_tokens": 20000, "ignore_eos": True, "stream": True}


def processes() -> Iterator[tuple[int, str, list[str]]]:
    """(pid, kernel name, the /proc/PID/stat fields after the name: state, ppid, pgrp, session, ...)"""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        yield int(stat.parent.name), text[text.index("(") + 1:text.rindex(")")], text[text.rindex(")") + 2:].split()


def engine_pid(parent: int) -> int:
    """The engine process the daemon `parent` started (by its kernel name and parent pid)."""
    for pid, name, fields in processes():
        if name == PROCESS_NAME and int(fields[1]) == parent:
            return pid
    raise AssertionError(f"no {PROCESS_NAME} process under {parent}")


def gone(pid: int) -> bool:
    """Exited (a zombie not yet reaped by whoever adopted it counts as exited)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return True
    return text[text.rindex(")") + 2] == "Z"


def stream_in_background(running: Daemon) -> tuple[threading.Thread, list[str], threading.Event]:
    lines: list[str] = []
    started = threading.Event()

    def consume() -> None:
        with httpx.stream("POST", running.url + "/v1/completions", json=ENDLESS, timeout=PATIENCE) as resp:
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    lines.append(line)
                    started.set()

    thread = threading.Thread(target=consume)
    thread.start()
    assert started.wait(PATIENCE)
    return thread, lines, started


def test_a_killed_engine_process_is_a_503_with_the_cause_then_an_exit() -> None:
    running = start_daemon()
    try:
        pid = engine_pid(running.proc.pid)
        thread, lines, _ = stream_in_background(running)
        os.kill(pid, signal.SIGKILL)
        thread.join(timeout=PATIENCE)
        assert not thread.is_alive()
        assert lines[-1] == "data: [DONE]"
        error = json.loads(lines[-2][6:])["error"]
        assert "killed by SIGKILL" in error["message"] and error["code"] == "generation_failed"
        # README's contract: 503s for ENGINE_DEATH_GRACE (2 s) after the death, then the exit. These
        # two loopback requests must fall in that window: the one time window left here, and far
        # wider than they need even on a busy machine.
        health = httpx.get(running.url + "/health", timeout=PATIENCE)
        assert health.status_code == 503 and "killed by SIGKILL" in health.json()["error"]["message"]
        refused = httpx.post(running.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=PATIENCE)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_dead"
        assert "killed by SIGKILL" in refused.json()["error"]["message"]
        wait_until(lambda: running.proc.poll() is not None, "the daemon to exit")
        assert running.proc.returncode == 1
    finally:
        running.stop(signal.SIGKILL)
    assert "engine process exited unexpectedly" in Path(running.log.name).read_text()


def test_a_stopped_engine_is_a_503_then_healthy_again_then_past_the_watchdog_an_exit() -> None:
    """`kill -STOP` of the engine process (a step that never finishes): /health says so after
    --stall-timeout while everything else keeps answering; SIGCONT makes it healthy again; stopped
    past --watchdog-timeout, the daemon ends the engine, the open stream gets an error and [DONE], and
    the daemon exits 1 with the cause."""
    running = start_daemon("--stall-timeout", "2", "--watchdog-timeout", "10")
    pid = engine_pid(running.proc.pid)
    try:
        os.kill(pid, signal.SIGSTOP)
        wait_until(lambda: httpx.get(running.url + "/health", timeout=PATIENCE).status_code == 503,
                   "/health to notice the stopped engine")
        error = httpx.get(running.url + "/health", timeout=PATIENCE).json()["error"]
        assert error["code"] == "engine_stalled" and "engine not responding for" in error["message"]
        assert httpx.get(running.url + "/v1/models", timeout=PATIENCE).status_code == 200
        refused = httpx.post(running.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}, timeout=PATIENCE)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "engine_stalled"
        os.kill(pid, signal.SIGCONT)
        wait_until(lambda: httpx.get(running.url + "/health", timeout=PATIENCE).status_code == 200,
                   "/health once the engine runs again")
        thread, lines, _ = stream_in_background(running)
        os.kill(pid, signal.SIGSTOP)
        thread.join(timeout=PATIENCE)
        assert not thread.is_alive() and lines[-1] == "data: [DONE]"
        assert "not finished a step" in json.loads(lines[-2][6:])["error"]["message"]
        assert running.proc.wait(timeout=PATIENCE) == 1
        assert gone(pid)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)
        running.stop(signal.SIGKILL)
    log = Path(running.log.name).read_text()
    assert "--watchdog-timeout 10" in log


def test_sigterm_exits_0_and_leaves_no_engine_process() -> None:
    running = start_daemon()
    pid = engine_pid(running.proc.pid)
    assert running.stop(signal.SIGTERM) == 0
    wait_until(lambda: gone(pid), "the engine process to exit")


def test_the_engine_process_exits_when_the_front_end_is_killed() -> None:
    running = start_daemon()
    pid = engine_pid(running.proc.pid)
    running.stop(signal.SIGKILL)
    wait_until(lambda: gone(pid), "the engine process to exit")
    # It left by itself, for the right reason (not killed, not timed out elsewhere)...
    assert "the front end is gone; the engine process stops" in Path(running.log.name).read_text()
    # ...and within README's half a second of the front end's death: the interval it looks for its
    # parent at. Not timed here: how long it then takes to exit is the machine's business.
    assert core.POLL_SECONDS <= 0.5


def test_an_engine_startup_error_ends_the_daemon_with_its_message(tmp_path: Path) -> None:
    folder = tmp_path / "broken"
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "make-checkpoint", str(folder)],
                          cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (folder / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not a header}..")
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--model", str(folder),
                           "--no-kv-store", "--port", "0"], cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode != 0
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("v4serve serve: ") and "model.safetensors" in last


def test_an_engine_process_dying_while_loading_is_a_startup_error() -> None:
    from tests.faults import exit_while_loading

    client = EngineCoreClient(exit_while_loading, None, None, 1)
    with pytest.raises(EngineStartupError, match=r"exited while starting \(exit status 3\)"):
        client.wait_ready()


def test_the_front_end_never_imports_torch() -> None:
    code = "import sys, v4serve.server.serve; assert 'torch' not in sys.modules, 'torch imported'"
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
