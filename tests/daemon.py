"""Start the real daemon (`v4serve serve`) in a subprocess on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def daemon(*args: str, env: dict[str, str] | None = None, timeout: float = 60.0) -> Iterator[str]:
    """Yield the base URL (http://127.0.0.1:PORT) of a running daemon; stop it afterwards."""
    port = free_port()
    if "--kv-store-dir" not in args and "--no-kv-store" not in args:
        args = (*args, "--no-kv-store")  # tests never write to the user's cache folder
    cmd = [sys.executable, "-m", "v4serve.server.cli", "serve", "--host", "127.0.0.1", "--port", str(port), *args]
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"v4serve-test-{port}.log", "w")  # noqa: SIM115
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})})
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}; see {log.name}")
            try:
                if httpx.get(url + "/health", timeout=1.0).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"daemon did not become healthy in {timeout}s; see {log.name}")
            time.sleep(0.2)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
