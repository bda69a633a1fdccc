"""The engine-core process: the engine loop, fed and read over ZeroMQ.

`run_engine_core` is what the process runs (the front end starts it with the `spawn` method and
gives it a builder). Its main thread connects to the front end, builds the engine (reporting
`Ready` or `StartupFailed`), then receives messages and hands them to the `AsyncEngine` loop,
whose thread owns the engine. That thread sends one `Step` per engine step — the step's outputs,
command results and the stats snapshot after it — and, if the loop dies, `Dead` with the cause.

The process never outlives the front end: SIGINT and SIGTERM are ignored (a terminal's Ctrl-C or a
service manager reaches the whole group; the front end drives the graceful shutdown), and the
parent pid is watched every half second, while loading too.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

import zmq

from v4serve.engine.engine import LLMEngine
from v4serve.engine.process.async_engine import AsyncEngine, TokenOutput, public_reason
from v4serve.engine.process.client import EngineDead
from v4serve.engine.process.ipc import (
    PROCESS_NAME,
    Abort,
    BeginShutdown,
    Channel,
    Command,
    CommandResult,
    CoreAddresses,
    Dead,
    FromCore,
    Pause,
    Ready,
    Shutdown,
    StartupFailed,
    Step,
    Submit,
    ToCore,
)
from v4serve.engine.process.lifecycle import freeze_startup_objects, setup_subordinate
from v4serve.engine.stats import EngineStats

log = logging.getLogger(__name__)

POLL_SECONDS = 0.5  # how often the parent (and the other ranks) are looked for when no message arrives
RANK_DIED = -1  # `serve`'s answer when another rank of a parallel engine has exited
SEND_LINGER_MS = 2000  # at exit, how long the last messages may take to leave

# Engine operations the front end may ask for by name (they replace running a function on the
# engine thread, which cannot cross a process boundary).
COMMANDS: dict[str, Callable[..., object]] = {
    "reset_prefix_cache": lambda engine, store=False: engine.reset_prefix_cache(store=bool(store)),
    # Raises if a block's refcount differs from the block tables that hold it (load tests, audits).
    "check_cache_integrity": lambda engine: engine.kv.check_integrity([r.kv for r in engine.scheduler.running]),
    # Every rank's DeviceKV digest, rank 0 first (under parallelism they must all be equal).
    "kv_digests": lambda engine: engine.kv_digests(),
    # The scheduler's queues and each request's progress (SIGUSR1's state dump).
    "describe": lambda engine: engine.describe(),
}

Builder = Callable[[], tuple[LLMEngine, dict[str, Any]]]


def run_engine_core(build: Builder, addresses: CoreAddresses, parent_pid: int) -> int:
    """The process's life; returns its exit status (0 after a requested shutdown or once the front
    end is gone, 1 after a startup error or a dead engine loop). Front end 0 (the process that started
    this one) is in charge: it alone asks for a shutdown."""
    setup_subordinate(PROCESS_NAME)
    context = zmq.Context()
    to_fronts, from_fronts = [], []
    for outputs, inputs in zip(addresses.outputs, addresses.inputs, strict=True):
        to_front = context.socket(zmq.PUSH)
        to_front.setsockopt(zmq.SNDHWM, 0)  # never block the engine thread; the front ends keep up
        to_front.setsockopt(zmq.LINGER, SEND_LINGER_MS)
        to_front.connect(outputs)  # queued until that front end binds (the later API servers start after Ready)
        to_fronts.append(to_front)
        from_front = context.socket(zmq.PULL)
        from_front.setsockopt(zmq.RCVHWM, 0)
        from_front.setsockopt(zmq.LINGER, 0)
        from_front.connect(inputs)
        from_fronts.append(from_front)
    try:
        built = _build(build, to_fronts[0], parent_pid)
        if built is None:
            return 1
        freeze_startup_objects()
        core = EngineCore(built[0], to_fronts)
        core.ready(built[1])
        code = core.serve(from_fronts, parent_pid)
        if code == RANK_DIED:  # the engine thread may be stuck in a collective: leave without it
            for sock in to_fronts:
                sock.close(linger=SEND_LINGER_MS)  # `_silence`d: the engine thread no longer sends
            for sock in from_fronts:
                sock.close()
            context.term()  # waits for `Dead` to leave
            built[0].ranks.kill()
            os._exit(1)
        return code
    finally:
        for sock in to_fronts + from_fronts:
            sock.close()
        context.term()


def _build(build: Builder, to_front: zmq.Socket, parent_pid: int) -> tuple[LLMEngine, dict[str, Any]] | None:
    """Build the engine while a watchdog ends the process if the front end goes away meanwhile."""
    loaded = threading.Event()
    threading.Thread(target=_watch_parent_while_loading, args=(parent_pid, loaded), daemon=True,
                     name="v4serve-parent-watch").start()
    try:
        return build()
    except Exception as exc:  # reported to the front end, which exits with it
        invalid = isinstance(exc, (ValueError, OSError))
        if not invalid:
            log.exception("the engine could not start")
        to_front.send(Channel(FromCore).encode(StartupFailed(str(exc), invalid)))
        return None
    finally:
        loaded.set()


def _watch_parent_while_loading(parent_pid: int, loaded: threading.Event) -> None:
    while not loaded.wait(POLL_SECONDS):
        if os.getppid() != parent_pid:  # nothing to save yet: leave at once
            os._exit(1)


class EngineCore:
    """The engine loop with its front ends at the other end of two sockets each."""

    def __init__(self, engine: LLMEngine, to_fronts: list[zmq.Socket]) -> None:
        self.engine = engine
        self.loop = AsyncEngine(engine, on_publish=self._flush)
        self.loop.on_death(self._died)
        self._to_fronts = to_fronts
        # One channel per thread: the main thread decodes what arrives, the engine thread encodes.
        self._in = Channel(ToCore)
        self._out = Channel(FromCore)  # encodes only: the type names what it carries
        # Filled by sinks on the engine thread and sent from there, per front end: no lock needed.
        self._outputs: list[list[tuple[str, TokenOutput]]] = [[] for _ in to_fronts]
        self._results: list[list[CommandResult]] = [[] for _ in to_fronts]
        self._send_lock = threading.Lock()  # the main thread sends too when a rank dies
        self._silenced = False

    def ready(self, info: dict[str, Any]) -> None:
        self._send_all(Ready(self.engine.limits, self.engine.config.max_waiting, info, self.engine.stats(),
                             os.getpid()))

    def serve(self, from_fronts: list[zmq.Socket], parent_pid: int) -> int:
        self.loop.start()
        timeout_ms = int(POLL_SECONDS * 1000)
        code = 0
        try:
            code = self._watch(from_fronts, parent_pid, timeout_ms)
            return code
        finally:
            if code != RANK_DIED:  # else the engine thread may be stuck in a collective: not joined
                self.loop.shutdown()  # the loop's thread ends; queued SSD-store writes land

    def _watch(self, from_fronts: list[zmq.Socket], parent_pid: int, timeout_ms: int) -> int:
        poller = zmq.Poller()
        for sock in from_fronts:
            poller.register(sock, zmq.POLLIN)
        while True:
            ready = dict(poller.poll(timeout_ms))
            for front, sock in enumerate(from_fronts):
                if sock in ready and self._receive(sock, front):
                    return 0
            if os.getppid() != parent_pid:
                log.warning("the front end is gone; the engine process stops")
                return 0
            if self.loop.error is not None:
                return 1  # a failed parallel step has marked the ranks broken: shutdown kills them
            if (dead := self.engine.dead_rank()) is not None:
                log.error("%s; the engine stops", dead)
                self._send_all(Dead(f"{dead}; the engine cannot run without it"))
                self._silence()
                return RANK_DIED

    def _receive(self, from_front: zmq.Socket, front: int) -> bool:
        """Handle every message waiting from one front end; True once the one in charge (0) asked to stop."""
        while True:
            try:
                frame = from_front.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return False
            message = self._in.decode(frame.buffer)
            if isinstance(message, Shutdown):
                if front == 0:
                    return True
                continue
            try:
                self._handle(message, front)
            except EngineDead:
                pass  # the loop has stopped; the front ends hear it from `Dead`

    def _handle(self, message: Any, front: int) -> None:
        if isinstance(message, Submit):
            ids, outputs = [r.request_id for r in message.requests], self._outputs[front]
            self.loop.enqueue([r.request() for r in message.requests],
                              lambda out: outputs.append((ids[out.index], out)), source=front)
        elif isinstance(message, Abort):
            self.loop.abort(message.request_ids)
        elif isinstance(message, Pause):
            self.loop.pause(message.request_ids, message.paused)
        elif isinstance(message, Command):
            self._command(message, self._results[front])
        elif isinstance(message, BeginShutdown):
            self.loop.begin_shutdown(message.timeout)

    def _command(self, command: Command, results: list[CommandResult]) -> None:
        def done(value: object, error: BaseException | None) -> None:
            text = None if error is None else public_reason(error)
            if error is not None and not isinstance(error, EngineDead):
                log.error("engine command %s failed", command.name, exc_info=error)
            results.append(CommandResult(command.id, None if error else value, text))

        fn = COMMANDS.get(command.name)
        if fn is None:
            results.append(CommandResult(command.id, None, f"unknown engine command {command.name!r}"))
            return
        self.loop.run_on_engine(lambda engine: fn(engine, **command.kwargs), done)

    # ---- the engine thread ----------------------------------------------------------------------
    def _flush(self, stats: EngineStats) -> None:
        """The step's outputs to the front ends that asked for them, and the snapshot to every one (it is
        also how each knows the engine is alive)."""
        accepted = self.loop.accepted_from
        for front, (outputs, results) in enumerate(zip(self._outputs, self._results, strict=True)):
            self._send(Step(outputs[:], results[:], stats, accepted.get(front, 0)), front)
            outputs.clear()
            results.clear()

    def _died(self, reason: str) -> None:
        self._send_all(Dead(reason))

    def _send_all(self, message: Any) -> None:
        with self._send_lock:
            if not self._silenced:
                frame = self._out.encode(message)
                for sock in self._to_fronts:
                    sock.send(frame, copy=False)

    def _send(self, message: Any, front: int) -> None:
        with self._send_lock:  # the encoder is not shared between threads unguarded
            if not self._silenced:
                self._to_fronts[front].send(self._out.encode(message), copy=False)

    def _silence(self) -> None:
        """Nothing more is sent (the sockets are about to close under the engine thread)."""
        with self._send_lock:
            self._silenced = True
