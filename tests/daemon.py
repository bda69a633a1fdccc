"""Start the real daemon (`v4serve serve`) in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import httpx

from v4serve.engine.process.client import EngineClient
from v4serve.server.serve import ServeConfig, build

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Daemon:
    proc: subprocess.Popen
    url: str
    log: IO[str]

    def stop(self, sig: int = signal.SIGINT, timeout: float = 15) -> int:
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


def start_daemon(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0,
                 port: int | None = None) -> Daemon:
    """A healthy daemon (the tiny model unless args say otherwise) on `port` (default: a free one);
    the caller stops it."""
    port = port or free_port()
    if "--kv-store-dir" not in args and "--no-kv-store" not in args:
        args = (*args, "--no-kv-store")  # tests never write to the user's cache folder
    cmd = [sys.executable, "-m", "v4serve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"v4serve-test-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
    running = Daemon(proc, f"http://127.0.0.1:{port}", log)
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            log.close()
            raise RuntimeError(f"daemon exited with {proc.returncode}; see {log.name}")
        try:
            if httpx.get(running.url + "/health", timeout=1.0).status_code == 200:
                return running
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            running.stop(signal.SIGKILL)
            raise RuntimeError(f"daemon did not become healthy in {timeout}s; see {log.name}")
        time.sleep(0.2)


@contextmanager
def daemon(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a running daemon; stop it afterwards."""
    running = start_daemon(*args, env=env, timeout=timeout)
    try:
        yield running.url
    finally:
        running.stop()


@contextmanager
def in_process_server(cfg: ServeConfig) -> Iterator[tuple[str, EngineClient]]:
    """The real app under uvicorn in a thread of this process (the engine in its own process unless
    cfg says otherwise), so a test can read its engine client; faults go in with cfg.engine_hook."""
    import uvicorn

    app, engine = build(cfg)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}", engine
    finally:
        server.should_exit = True
        thread.join(timeout=15)
