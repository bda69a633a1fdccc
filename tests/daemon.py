"""Start the real daemon (`v4serve serve`) in a subprocess, or the real app under uvicorn in this
process, each on a loopback port the system picks as it binds (port 0), and the one patience every
test waits with."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from v4serve.engine.process.client import EngineClient
from v4serve.server.serve import ServeConfig, bind_sockets, build, served_url

ROOT = Path(__file__).resolve().parents[1]

# Seconds any wait in the tests may last whose only job is to turn a hang into a failure (a daemon
# starting, a request, a thread ending, a gauge settling): far beyond what a busy machine needs, so a
# slow run never fails on time, while a real hang still fails. Tests assert what happened and in
# which order, never how fast.
PATIENCE = 300.0

# The daemon's "serving MODEL at http://HOST:PORT/v1 ..." line (server/serve.py `run`).
SERVING = re.compile(r"serving .* at (http://\S+)/v1 \(OpenAI-compatible")


def wait_until(condition: Callable[[], object], what: str, timeout: float = PATIENCE) -> None:
    """Poll `condition` until it holds; fail naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out after {timeout:.0f} s waiting for {what}"
        time.sleep(0.02)


def served_at(log: str) -> str | None:
    """The base URL (http://HOST:PORT) a daemon's log says it serves at, once it says so."""
    found = SERVING.search(log)
    return found.group(1) if found else None


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    log: IO[str]

    def stop(self, sig: int = signal.SIGINT, timeout: float = PATIENCE) -> int:
        """Signal the daemon and wait for it (killed if it overstays); returns its exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        return self.proc.returncode


def _tail(path: str, lines: int = 30) -> str:
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


def start_daemon(*args: str, env: dict[str, str] | None = None, timeout: float = PATIENCE,
                 port: int | None = None) -> Daemon:
    """A healthy daemon (the tiny model unless args say otherwise) on `port`, by default one the
    daemon has the system pick as it binds (`--port 0`; read back from its log); the caller stops it."""
    if "--kv-store-dir" not in args and "--no-kv-store" not in args:
        args = (*args, "--no-kv-store")  # tests never write to the user's cache folder
    cmd = [sys.executable, "-m", "v4serve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port or 0), *args]
    fd, name = tempfile.mkstemp(prefix="v4serve-test-", suffix=".log", dir=os.environ.get("TMPDIR", "/tmp"))
    os.close(fd)
    log = open(name, "w")  # noqa: SIM115 - the Daemon closes it
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    deadline = time.monotonic() + timeout
    url = None
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"daemon exited with {proc.returncode}; see {name}:\n{_tail(name)}")
        url = url or served_at(Path(name).read_text(errors="replace"))
        if url is not None:  # it listens from the moment it says so; /health answers once uvicorn runs
            try:
                if httpx.get(url + "/health", timeout=max(1.0, deadline - time.monotonic())).status_code == 200:
                    return Daemon(proc, url, log)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            Daemon(proc, url or "", log).stop(signal.SIGKILL)
            raise RuntimeError(f"daemon did not become healthy in {timeout:.0f} s; see {name}:\n{_tail(name)}")
        time.sleep(0.1)


@contextmanager
def daemon(*args: str, env: dict[str, str] | None = None, timeout: float = PATIENCE) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a running daemon; stop it afterwards."""
    running = start_daemon(*args, env=env, timeout=timeout)
    try:
        yield running.url
    finally:
        running.stop()


@contextmanager
def in_process_server(cfg: ServeConfig) -> Iterator[tuple[str, EngineClient]]:
    """The real app under uvicorn in a thread of this process (the engine in its own process unless
    cfg says otherwise), so a test can read its engine client; faults go in with cfg.engine_hook.
    It listens on a loopback port the system picks as it binds (cfg's host and port are not used)."""
    import uvicorn

    sockets = bind_sockets("127.0.0.1", 0)
    try:
        app, engine = build(cfg)
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        thread = threading.Thread(target=server.run, kwargs={"sockets": sockets}, daemon=True)
        thread.start()
        try:
            wait_until(lambda: server.started or not thread.is_alive(), "the in-process server to start")
            assert server.started, "the in-process server did not start (its error is logged above)"
            yield served_url(sockets[0]), engine
        finally:
            server.should_exit = True
            thread.join(timeout=PATIENCE)
            engine.shutdown()  # idempotent: normally the app's lifespan has done it
    finally:
        for sock in sockets:
            sock.close()
