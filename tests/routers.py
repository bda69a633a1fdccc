"""vLLM's and SGLang's routers (the pinned Rust binaries from PyPI) started over replicas on loopback
ports: shared by tests/test_routers.py, tests/test_fleet.py, tests/test_pd.py, bench/bench_fleet.py and
bench/bench_pd.py."""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from tests.daemon import PATIENCE, wait_until

VLLM_ROUTER = [sys.executable, "-m", "vllm_router.launch_router"]
SGLANG_ROUTER = [sys.executable, "-m", "sglang_router.launch_router"]

# What `ready` sends: a request the router must pass to a worker and get answered, the only proof it
# routes (a router may listen before it has found its workers healthy).
PROBE = {"model": "v4serve-tiny", "prompt": "the shared document, then a question", "max_tokens": 6,
         "temperature": 0}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def router(command: Sequence[str], workers: Sequence[str], policy: str = "cache_aware",
           extra: Sequence[str] = ()) -> Iterator[str]:
    """A router over `workers` on a port picked now (picked again if another process takes it first).
    Each gets its own `--prometheus-port` too: the routers' default one is shared by every router."""
    for _ in range(5):
        port, metrics_port = free_port(), free_port()
        log = tempfile.NamedTemporaryFile("w+", prefix="v4serve-router-", suffix=".log", delete=False)  # noqa: SIM115
        listed = ["--worker-urls", *workers] if workers else []  # none: PD mode lists its own in `extra`
        proc = subprocess.Popen([*command, "--host", "127.0.0.1", "--port", str(port), "--prometheus-port",
                                 str(metrics_port), *listed, "--policy", policy, *extra],
                                stdout=log, stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        try:
            wait_until(lambda: proc.poll() is not None or ready(url), "the router to route")  # noqa: B023
            if proc.poll() is None:
                yield url
                return
            if "in use" not in Path(log.name).read_text(errors="replace"):
                raise AssertionError(f"the router exited: {Path(log.name).read_text(errors='replace')[-2000:]}")
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=PATIENCE)
            log.close()
    raise AssertionError("no free port for the router after 5 tries")


def ready(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return httpx.post(url + "/v1/completions", json=PROBE, timeout=PATIENCE).status_code == 200
    return False
