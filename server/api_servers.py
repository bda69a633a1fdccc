"""Several API-server processes (`--api-server-count N`, vLLM's flag): the HTTP front end's work
(parsing, detokenizing, framing each streamed token) spread over N processes, so a GPU node's spare
cores add up; one engine process serves them all.

The first API server (the process `v4serve serve` runs) binds the port, starts the engine and, once
the engine is ready, starts the other N-1 with the listening sockets: each accepts connections on
them (the kernel hands each new connection to one process) and talks to the engine over ZeroMQ
sockets of its own, so each request's outputs go back to the process that took it. What they
share lives in one private folder (`SharedFolder`, mode 0700): the metrics' values (any process
answers /metrics for all) and the Responses API's stored responses (a follow-up finds the response
it continues whichever process took either). Limits that protect an event loop (--max-connections)
and the preprocessing workers (--preprocess-workers) are per process.

The first API server is in charge: it passes SIGTERM and SIGHUP on to the others, waits for their
streams to end before it stops the engine, and exits non-zero (for a service manager to restart the
daemon) if one of them exits unasked. The others ignore a terminal's Ctrl-C (the first passes it on
as SIGTERM) and stop when the engine does.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from v4serve.engine.process.core_client import EngineCoreClient
from v4serve.engine.process.ipc import CoreAddresses
from v4serve.engine.process.lifecycle import describe_exit
from v4serve.server.config import ServeConfig

log = logging.getLogger("v4serve")

PROCESS_NAME = "v4serve-api"  # the other API servers' name in ps -o comm, top and /proc/PID/comm


@dataclass(frozen=True)
class SharedFolder:
    """What the API servers share, under one private folder."""

    root: str

    @classmethod
    def make(cls) -> SharedFolder:
        """A new folder (0700: only this user reads the stored conversations), its metric values made
        there from now on, in this process and those it starts."""
        from v4serve.server.metrics import use_multiprocess_values

        shared = cls(tempfile.mkdtemp(prefix="v4serve-api-"))
        os.mkdir(shared.metrics, 0o700)
        os.mkdir(shared.responses, 0o700)
        use_multiprocess_values(shared.metrics)
        return shared

    @property
    def metrics(self) -> str:
        return os.path.join(self.root, "metrics")

    @property
    def responses(self) -> str:
        return os.path.join(self.root, "responses")

    @property
    def handovers(self) -> str:
        """The transfer ids a prefill replica's processes have taken prefill legs for (server/handover.py)."""
        return os.path.join(self.root, "handovers")

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


@dataclass(frozen=True)
class ApiServerSpec:
    """What one of the other API servers is started with (pickled across the spawn)."""

    cfg: ServeConfig
    index: int
    addresses: CoreAddresses  # its own pair of the engine's sockets
    engine_pid: int
    shared: SharedFolder
    created: int  # /v1/models' `created`: the same from every process


class ApiServers:
    """The API servers after the first, started with the listening sockets once the engine is ready."""

    def __init__(self, cfg: ServeConfig, sockets: list[socket.socket], engine: EngineCoreClient,
                 shared: SharedFolder, created: int, target: Callable[[ApiServerSpec, list[socket.socket]], None]
                 ) -> None:
        """`target(spec, sockets)`: what each runs (`serve.run_api_server`)."""
        context = multiprocessing.get_context("spawn")  # a fork would copy the event loop and its threads
        self.processes = [
            context.Process(target=target, name=f"{PROCESS_NAME}-{index}",
                            args=(ApiServerSpec(cfg, index, engine.addresses.front(index), engine.pid, shared,
                                                created), sockets))
            for index in range(1, cfg.api_server_count)]
        for process in self.processes:
            process.start()
        self.grace = cfg.shutdown_timeout + 10.0  # --shutdown-timeout, uvicorn's margin, then their exit
        self._stopping = False
        self._failure: str | None = None
        self._on_failure: Callable[[str], None] | None = None
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="v4serve-api-servers", daemon=True).start()

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` once one of them exits unasked (at once if one already has)."""
        with self._lock:
            self._on_failure, failure = callback, self._failure
        if failure is not None:
            callback(failure)

    def signal(self, sig: int) -> None:
        for process in self.processes:
            if process.exitcode is None and process.pid is not None:
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass

    def stop(self) -> None:
        """SIGTERM to each (their running requests get --shutdown-timeout), then wait for them; one
        still running after that is killed. Idempotent."""
        self._stopping = True
        self.signal(signal.SIGTERM)
        deadline = time.monotonic() + self.grace
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.exitcode is None:
                log.warning("API server %s did not stop within %.0f s; killing it", process.name, self.grace)
                process.kill()
                process.join()

    def _watch(self) -> None:
        waiting = {process.sentinel: process for process in self.processes}
        while waiting:
            for sentinel in multiprocessing.connection.wait(list(waiting)):
                process = waiting.pop(sentinel)  # type: ignore[call-overload]
                process.join()
                if self._stopping:
                    continue
                reason = f"API server {process.name} (pid {process.pid}) exited ({describe_exit(process.exitcode)})"
                with self._lock:
                    self._failure = self._failure or reason
                    callback = self._on_failure
                if callback is not None:
                    callback(reason)
