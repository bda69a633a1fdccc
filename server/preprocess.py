"""Preprocessing off the front end's process: rendering conversations, tokenizing, checking tools and
schemas, building grammars' text and counting tokens run in worker processes.

One request's preprocessing can cost seconds of pure Python (a 10,000-property tool schema, a
megabyte of messages); on a thread of the front end it would hold the GIL from the event loop, so
every other client and `/health` would wait. In a worker process it holds nothing of the front end's:
workers run at a lower priority (`nice`) than the front end and the engine, each job is bounded by
`cpu_seconds` of CPU time (a 400 past it, `PreprocessTooCostly`; the worker is then replaced, since
the job was cut anywhere), and a worker stuck in native code, where the bound's signal cannot reach
it, is killed once it has used `HARD_DEADLINE_FACTOR` times that, and replaced. A worker that dies
mid-job (killed from outside, out of memory) is replaced and the job run once more on the fresh one
(every job is a pure function of its arguments, so running it again is safe); if that one dies too,
the request gets a retryable 503 (`PreprocessWorkerDied`), never a 500. CPU time, not wall
time: a busy machine makes a job slower, never refused. With `workers = 0` jobs run on a thread
of the front end instead (no CPU bound: for tests and debugging).

A job is a module-level function taking the tokenizer first (`job(tokenizer, *args)`), with arguments
and a result that pickle cheaply: plain data in, token ids (as `array`) and small values out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import multiprocessing.connection
import os
import pickle
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from v4serve.server.errors import ApiError, internal_error

log = logging.getLogger(__name__)

T = TypeVar("T")
# What the fork server imports once, so each worker it forks starts with the jobs' modules loaded.
PRELOAD = ["v4serve.server.jobs", "v4serve.server.messages", "v4serve.server.responses"]
# A worker whose job has used this many times the CPU bound without the bound's signal ending it is
# stuck in native code (the signal's handler runs only between Python instructions): it is killed.
HARD_DEADLINE_FACTOR = 3
# A job that has used no CPU for this long is stuck waiting on something: killed too.
IDLE_DEADLINE = 600.0
# Worker processes run this much nicer than the front end: under contention the engine and the event
# loop come first, preprocessing takes what is left.
WORKER_NICENESS = 10


class PreprocessWorkerDied(ApiError):
    def __init__(self) -> None:
        super().__init__(503, "the process preparing this request died twice running it (a fresh one was started "
                         "each time); retry the request", "server_error", code="preprocess_worker_died",
                         headers={"Retry-After": "1"})


class PreprocessTooCostly(ApiError):
    def __init__(self, cpu_seconds: float) -> None:
        super().__init__(400, f"preparing this request took more than {cpu_seconds:g} s of CPU time "
                         "(--max-preprocess-seconds); send fewer or smaller messages, tools or schemas",
                         code="request_too_costly")


@dataclass(frozen=True)
class PreprocessConfig:
    workers: int = 2  # 0: a thread of the front end
    cpu_seconds: float = 10.0  # per job, in a worker
    model: str = "tiny"  # what the workers load their tokenizer from (`serve.load_front_tokenizer`)


class _CpuLimit(BaseException):
    """Raised in a worker by SIGPROF once a job has used its CPU time (not an Exception: nothing in
    the job can catch it by accident)."""


def _on_cpu_limit(_signum: int, _frame: Any) -> None:
    raise _CpuLimit


def _worker_main(conn: multiprocessing.connection.Connection, model: str, cpu_seconds: float) -> None:
    """A worker: load the tokenizer, then run jobs until the front end closes the pipe."""
    from v4serve.server.config import is_embedded
    from v4serve.server.text.tokenizer import embedded_tokenizer, load_tokenizer

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the front end decides when workers end
    with contextlib.suppress(OSError):
        os.nice(WORKER_NICENESS)
    tokenizer = embedded_tokenizer(model) if is_embedded(model) else load_tokenizer(model)
    signal.signal(signal.SIGPROF, _on_cpu_limit)
    conn.send_bytes(b"ready")
    while True:
        try:
            job, args, kwargs = pickle.loads(conn.recv_bytes())
        except EOFError:
            return
        try:
            signal.setitimer(signal.ITIMER_PROF, cpu_seconds)  # user + system CPU time of this process
            try:
                reply: tuple[str, Any] = ("ok", job(tokenizer, *args, **kwargs))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except _CpuLimit:
            conn.send_bytes(pickle.dumps(("cpu_limit", None)))
            return  # cut anywhere: a fresh worker takes over
        except ApiError as exc:
            reply = ("api_error", (exc.status, exc.message, exc.type, exc.param, exc.code))
        except Exception as exc:  # noqa: BLE001 - reported to the front end, which logs it
            reply = ("failed", f"{type(exc).__name__}\n{traceback.format_exc()}")
        conn.send_bytes(pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))


class _Worker:
    def __init__(self, context: Any, config: PreprocessConfig) -> None:
        self.conn, child = context.Pipe()
        self.process = context.Process(target=_worker_main, args=(child, config.model, config.cpu_seconds),
                                       name="v4serve-preprocess", daemon=True)
        self.process.start()
        child.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> None:
        if not self.conn.poll(timeout) or self.conn.recv_bytes() != b"ready":
            raise RuntimeError("a preprocessing worker did not start")
        self.ready = True

    def cpu_seconds(self) -> float | None:
        """CPU time the worker has used so far (Linux: /proc; None where that cannot be read)."""
        try:
            with open(f"/proc/{self.process.pid}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime

    def kill(self) -> None:
        with contextlib.suppress(Exception):
            self.conn.close()
        if self.process.is_alive():
            self.process.kill()
        self.process.join(timeout=5)


class Preprocessor:
    """Runs preprocessing jobs: `await prep.run(job, *args)`. Jobs queue for the next free worker."""

    def __init__(self, tokenizer: Any, config: PreprocessConfig = PreprocessConfig()) -> None:
        self.tokenizer, self.config = tokenizer, config
        self._context = multiprocessing.get_context("forkserver") if config.workers else None
        self._workers: list[_Worker | None] = [None] * config.workers
        self._free: queue.SimpleQueue[int] = queue.SimpleQueue()  # workers not running a job
        for slot in range(config.workers):
            self._free.put(slot)
        # Sends and receives block on the workers' pipes: one thread each, off the event loop.
        self._io = ThreadPoolExecutor(max(1, config.workers), thread_name_prefix="v4serve-preprocess")
        self._lock = threading.Lock()
        self.replaced = 0  # workers replaced after a CPU bound or a hang
        self._closed = False
        self.on_cpu_limit: Callable[[], None] = lambda: None  # a job refused for its CPU time (a metric)

    def start(self) -> None:
        """Start the workers (each loads the tokenizer); the first job a worker gets waits until it is ready."""
        if self._context is None:
            return
        self._context.set_forkserver_preload(PRELOAD)
        self._workers = [_Worker(self._context, self.config) for _ in range(self.config.workers)]

    def close(self) -> None:
        self._closed = True  # the jobs whose workers this kills are not run again
        for worker in self._workers:
            if worker is not None:
                worker.kill()
        self._workers = [None] * self.config.workers
        self._io.shutdown(wait=False, cancel_futures=True)

    async def run(self, job: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        if self._context is None:
            return await asyncio.to_thread(job, self.tokenizer, *args, **kwargs)
        # The IO pool has one thread per worker: a thread that gets the job always finds a free worker,
        # and jobs beyond that wait in the pool's queue, first come first served.
        kind, value = await asyncio.get_running_loop().run_in_executor(self._io, self._round_trip, job, (args, kwargs))
        if kind == "ok":
            return value
        if kind == "api_error":
            raise ApiError(*value)
        if kind in ("cpu_limit", "hung"):
            self.on_cpu_limit()
            raise PreprocessTooCostly(self.config.cpu_seconds)
        if kind == "died":
            log.error("a preprocessing worker died running %s twice over: the request gets a 503", job.__name__)
            raise PreprocessWorkerDied
        raise internal_error(RuntimeError(value), f"preprocessing ({job.__name__}) failed")

    def _round_trip(self, job: Callable[..., Any], arguments: tuple[tuple[Any, ...], dict[str, Any]]
                    ) -> tuple[str, Any]:
        """On an IO thread: hand the job to a free worker and wait for its answer (replacing a worker
        that hit the CPU bound, died or hangs; a job whose worker died runs once more on its replacement)."""
        slot = self._free.get_nowait()
        try:
            kind, value = self._on_worker(slot, job, arguments)
            if kind == "died" and not self._closed:
                log.warning("a preprocessing worker died running %s (%s): replaced, the job runs again",
                            job.__name__, value)
                kind, value = self._on_worker(slot, job, arguments)
            return kind, value
        finally:
            self._free.put_nowait(slot)

    def _on_worker(self, slot: int, job: Callable[..., Any], arguments: tuple[tuple[Any, ...], dict[str, Any]]
                   ) -> tuple[str, Any]:
        worker = self._worker(slot)
        try:
            worker.conn.send_bytes(pickle.dumps((job, *arguments), protocol=pickle.HIGHEST_PROTOCOL))
            if not self._answered(worker):
                log.error("a preprocessing worker stopped answering (%s): replaced", job.__name__)
                self._replace(slot)
                return "hung", None
            kind, value = pickle.loads(worker.conn.recv_bytes())
        except (EOFError, OSError) as exc:
            self._replace(slot)
            return "died", type(exc).__name__
        if kind == "cpu_limit":
            log.warning("a request's preprocessing (%s) passed %g s of CPU time: refused, its worker replaced",
                        job.__name__, self.config.cpu_seconds)
            self._replace(slot)
        return kind, value

    def _answered(self, worker: _Worker) -> bool:
        """Wait for the worker's answer; False if it is stuck: past HARD_DEADLINE_FACTOR times the CPU
        bound in CPU time (the bound's signal did not end it), or IDLE_DEADLINE without using any CPU."""
        start = last = worker.cpu_seconds()
        quiet_since = time.monotonic()
        while not worker.conn.poll(0.5):
            used = worker.cpu_seconds()
            if used is None or start is None:  # no CPU times to read: wall time decides, generously
                if time.monotonic() - quiet_since > IDLE_DEADLINE:
                    return False
                continue
            if used - start > HARD_DEADLINE_FACTOR * self.config.cpu_seconds + 1:
                return False
            if used != last:
                last, quiet_since = used, time.monotonic()
            elif time.monotonic() - quiet_since > IDLE_DEADLINE:
                return False
        return True

    def _worker(self, slot: int) -> _Worker:
        with self._lock:
            worker = self._workers[slot]
            if worker is None:
                assert self._context is not None
                worker = self._workers[slot] = _Worker(self._context, self.config)
        if not worker.ready:
            worker.wait_ready(timeout=300)
        return worker

    def _replace(self, slot: int) -> None:
        with self._lock:
            worker, self._workers[slot] = self._workers[slot], None
            self.replaced += 1
        if worker is not None:
            worker.kill()
