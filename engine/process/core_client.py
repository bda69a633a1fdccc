"""The front end's side of the engine-core process (`engine.core`): an `EngineClient`.

The process is started with the `spawn` method (a fork would copy torch's threads and locks) and
builds the engine itself from a frozen spec; `wait_ready` blocks until it reports `Ready` or its
startup error. Requests, aborts and named commands go out on one socket as they happen; a receiver
thread reads each step's outputs and stats snapshot from the other and hands them to the event loop
in one call per step. The same thread watches the process itself: if it exits unasked (a crash,
kill -9, the OOM killer), every open choice ends with an error, new requests and /health get 503
with the cause, and the `on_death` callbacks run — within a poll interval, never a hang.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import multiprocessing
import os
import select
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from v4serve.engine.process.client import EngineDead, TokenOutput, check_requests
from v4serve.engine.process.ipc import (
    PROCESS_NAME,
    Abort,
    BeginShutdown,
    Channel,
    Command,
    CoreAddresses,
    Dead,
    FromCore,
    Pause,
    Ready,
    Shutdown,
    StartupFailed,
    Step,
    Submit,
    WireRequest,
)
from v4serve.engine.process.lifecycle import describe_exit
from v4serve.engine.request import GrammarSpec, Request, RequestLimits
from v4serve.engine.stats import EngineStats
from v4serve.engine.structured import GRAMMAR_CACHE_TEXT_BYTES, Grammars, require

log = logging.getLogger(__name__)

Sink = Callable[[TokenOutput], None]
CoreTarget = Callable[[Any, CoreAddresses, int], None]

RECEIVE_POLL_MS = 500  # the receiver's wake-up interval when nothing arrives (to notice a stop)
LAST_WORDS_MS = 100  # after the process exits, how long what it sent last may take to arrive
SHUTDOWN_SECONDS = 120.0  # a requested shutdown waits this long for queued SSD-store writes


class EngineStartupError(RuntimeError):
    """The engine process could not start; the message says why."""


class EngineCommandError(RuntimeError):
    """A named engine command failed in the engine process."""


class _AttachedCore:
    """The engine process as seen by an API server that did not start it: through a pidfd, readable
    once the process has exited (its exit status goes to its parent, the first API server, which
    alone stops it)."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.sentinel = os.pidfd_open(pid)
        self.exitcode: int | None = None

    def join(self, timeout: float | None = None) -> None:
        select.select([self.sentinel], [], [], timeout)

    def kill(self) -> None:
        """Not this process's to end: its owner stops it."""

    def close(self) -> None:
        if self.sentinel >= 0:
            os.close(self.sentinel)
            self.sentinel = -1

    def describe_exit(self) -> str:
        return "its exit status goes to the first API server"


class _SpawnedCore:
    """The engine process this front end started and stops."""

    def __init__(self, process: multiprocessing.process.BaseProcess) -> None:
        self.process, self.pid, self.sentinel = process, process.pid, process.sentinel

    @property
    def exitcode(self) -> int | None:
        return self.process.exitcode

    def join(self, timeout: float | None = None) -> None:
        self.process.join(timeout)

    def kill(self) -> None:
        if self.process.exitcode is None:
            self.process.kill()
            self.process.join()

    def close(self) -> None:
        pass

    def describe_exit(self) -> str:
        return describe_exit(self.process.exitcode)


class EngineCoreClient:
    def __init__(self, target: CoreTarget, spec: Any, tokenizer_json: str | None, eos_token_id: int,
                 grammar_cache_bytes: int = GRAMMAR_CACHE_TEXT_BYTES, api_servers: int = 1) -> None:
        """Start the engine process now (`target(spec, addresses, parent_pid)` runs there); it loads
        while the caller does other work, and `wait_ready` collects it. `api_servers`: front ends it
        will serve, this one first (the others `attach` once it is ready, at `addresses.front(i)`)."""
        self._owner = True
        self._folder = tempfile.mkdtemp(prefix="v4serve-ipc-")  # 0700: no other user can connect
        self.addresses = CoreAddresses.in_folder(self._folder, api_servers)
        process = multiprocessing.get_context("spawn").Process(
            target=target, args=(spec, self.addresses, os.getpid()), name=PROCESS_NAME)
        self._connect(self.addresses.front(0), tokenizer_json, eos_token_id, grammar_cache_bytes)
        process.start()
        self._core: _SpawnedCore | _AttachedCore = _SpawnedCore(process)
        self.pid = process.pid
        atexit.register(self.kill)  # before multiprocessing's own exit hook would wait for it

    @classmethod
    def attach(cls, addresses: CoreAddresses, pid: int, tokenizer_json: str | None, eos_token_id: int,
               grammar_cache_bytes: int = GRAMMAR_CACHE_TEXT_BYTES) -> EngineCoreClient:
        """A client of an engine process another API server started (`addresses`: this front end's
        pair): it sends no shutdown, and stopping it leaves the engine running."""
        client = cls.__new__(cls)
        client._owner = False
        client._folder = None
        client.addresses = addresses
        client._connect(addresses, tokenizer_json, eos_token_id, grammar_cache_bytes)
        client._core = _AttachedCore(pid)
        client.pid = pid
        atexit.register(client.kill)
        return client

    def _connect(self, addresses: CoreAddresses, tokenizer_json: str | None, eos_token_id: int,
                 grammar_cache_bytes: int) -> None:
        self._grammar_cache_bytes = grammar_cache_bytes
        self._context = zmq.Context()
        self._to_core = self._socket(zmq.PUSH, addresses.inputs[0])
        self._from_core = self._socket(zmq.PULL, addresses.outputs[0])
        self._send_channel = Channel(FromCore)  # used on the event loop (encodes)
        self._receive_channel = Channel(FromCore)  # used by the receiver thread (decodes)
        self._tokenizer_json, self._eos_token_id = tokenizer_json, eos_token_id
        self.limits: RequestLimits | None = None
        self.max_waiting = 0
        self.info: dict[str, Any] = {}
        self._stats = EngineStats()
        self._heard_at = time.monotonic()  # set by the receiver thread: the event loop may be what is stuck
        self._grammars: Grammars | None = None
        self._open: dict[str, tuple[Sink, int]] = {}  # choice request id → (its sink, choice index)
        self._commands: dict[int, asyncio.Future] = {}
        self._next_command = 0
        self._submitted = 0  # choices sent; those the engine has not yet taken count as waiting
        self._accepted = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._receiver: threading.Thread | None = None
        self._closing = False
        self._stopped = False  # a shutdown was asked for: the process's exit is expected
        self._dead: str | None = None
        self._death_callbacks: list[Callable[[str], None]] = []

    def _socket(self, kind: int, address: str) -> zmq.Socket:
        sock = self._context.socket(kind)
        sock.setsockopt(zmq.SNDHWM if kind == zmq.PUSH else zmq.RCVHWM, 0)  # queues never block or drop
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(address)
        return sock

    # ---- startup ------------------------------------------------------------------------------------
    def wait_ready(self) -> None:
        """Block until the engine has loaded. ValueError for a bad setting it found (a bad flag, a
        missing folder), EngineStartupError for any other failure; either way the process is gone."""
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self._core.sentinel, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if self._from_core in events:
                    message = self._receive_channel.decode(self._from_core.recv())
                    if isinstance(message, Ready):
                        self._ready(message)
                        return
                    if isinstance(message, StartupFailed):
                        raise (ValueError if message.invalid_config else EngineStartupError)(message.message)
                elif not self._from_core.poll(LAST_WORDS_MS):
                    raise EngineStartupError(f"the engine process exited while starting "
                                             f"({self._core.describe_exit()})")
        except BaseException:  # KeyboardInterrupt too: never leave the process behind
            self.kill()
            raise

    def _ready(self, ready: Ready) -> None:
        self.limits, self.max_waiting, self.info, self._stats = ready.limits, ready.max_waiting, ready.info, ready.stats
        if self._tokenizer_json:  # grammars are checked here, before a stream's first byte
            self._grammars = Grammars(self._tokenizer_json, ready.limits.vocab_size, self._eos_token_id,
                                      self._grammar_cache_bytes)
        log.info("engine process %d ready", ready.pid)

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._receiver = threading.Thread(target=self._receive, name="v4serve-engine-client", daemon=True)
        self._receiver.start()

    # ---- the EngineClient surface ---------------------------------------------------------------------
    @property
    def alive(self) -> bool:
        return self.unavailable_reason() is None

    def unavailable_reason(self) -> str | None:
        if self._closing:
            return "the server is shutting down"
        if self._dead is not None:
            return self._dead
        return None if self.limits is not None else "the engine is starting"

    @property
    def stats(self) -> EngineStats:
        if self._grammars is None:
            return self._stats
        return self._stats.with_grammars("front_end", self._grammars.text_bytes, self._grammars.compiles)

    def silent_for(self) -> float:
        return time.monotonic() - self._heard_at

    def on_death(self, callback: Callable[[str], None]) -> None:
        self._death_callbacks.append(callback)

    def check(self, requests: list[Request]) -> None:
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineDead(reason)
        assert self.limits is not None
        waiting = self._stats.waiting + self._submitted - self._accepted
        check_requests(requests, self.limits, self._check_grammar, waiting, self.max_waiting, self._stats.fetching)

    def _check_grammar(self, spec: GrammarSpec) -> None:
        require(self._grammars, spec).check(spec)

    def submit(self, requests: list[Request], on_output: Sink) -> None:
        self.check(requests)
        frame = self._send_channel.encode(Submit([WireRequest.of(r) for r in requests]))
        for i, r in enumerate(requests):
            self._open[r.request_id] = (on_output, i)
        try:
            self._send_frame(frame)
        except EngineDead:
            for r in requests:
                self._open.pop(r.request_id, None)
            raise
        self._submitted += len(requests)

    def abort(self, request_ids: list[str]) -> None:
        with contextlib.suppress(EngineDead):  # a dead engine holds nothing left to free
            self._send(Abort(request_ids))

    def pause(self, request_ids: list[str], paused: bool) -> None:
        with contextlib.suppress(EngineDead):
            self._send(Pause(request_ids, paused))

    async def reset_prefix_cache(self, store: bool = False) -> tuple[int, int]:
        dropped, removed = await self.command("reset_prefix_cache", store=store)
        return dropped, removed

    async def describe(self) -> dict[str, list[str]]:
        return await self.command("describe")

    async def command(self, name: str, **kwargs: Any) -> Any:
        """Run a named engine command (`engine.core.COMMANDS`) between steps and return its result;
        callable from any event loop (the socket is only ever used from the client's own)."""
        assert self._loop is not None
        if asyncio.get_running_loop() is self._loop:
            return await self._command(name, **kwargs)
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(self.command(name, **kwargs), self._loop))

    def _command(self, name: str, **kwargs: Any) -> asyncio.Future:
        future = asyncio.get_running_loop().create_future()
        self._next_command += 1
        self._send(Command(self._next_command, name, kwargs))
        self._commands[self._next_command] = future
        return future

    def begin_shutdown(self, timeout: float) -> None:
        """From a signal handler: the message goes out from the event loop, never mid-send (from the API
        server that started the engine: it stops the others)."""
        self._closing = True
        if self._owner and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                self._loop.call_soon_threadsafe(self._send_quietly, BeginShutdown(timeout))

    def shutdown(self) -> None:
        """Ask the process to stop (it lets its SSD-store writes land), wait for it, clean up."""
        if self._stopped:
            return
        self._stopped = self._closing = True
        if self._owner:
            self._send_quietly(Shutdown())
            self._core.join(SHUTDOWN_SECONDS)
            if self._core.exitcode is None:
                log.warning("the engine process did not stop within %.0f s; killing it", SHUTDOWN_SECONDS)
        self.kill()

    def abandon(self, reason: str) -> None:
        """From any thread, for an engine that has stopped answering: end its open requests and
        commands with `reason` (streams get an error event and [DONE]), then kill its process."""

        def end() -> None:
            self._die(reason)
            self.kill()

        self._post(end)

    def kill(self) -> None:
        """End the process at once (if it still runs and this front end started it) and release
        everything; idempotent."""
        self._stopped = True
        self._core.kill()
        if self._receiver is not None and self._receiver is not threading.current_thread():
            self._receiver.join(timeout=2 * RECEIVE_POLL_MS / 1000)
        self._core.close()  # after the receiver, which polls it
        if not self._context.closed:
            self._to_core.close()
            self._from_core.close()
            self._context.term()
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
        atexit.unregister(self.kill)

    # ---- sending (event loop) ----------------------------------------------------------------------------
    def _send(self, message: Any) -> None:
        self._send_frame(self._send_channel.encode(message))

    def _send_frame(self, frame: bytes) -> None:
        if self._dead is not None:
            raise EngineDead(self._dead)
        try:
            self._to_core.send(frame, zmq.NOBLOCK, copy=False)
        except zmq.ZMQError as exc:  # not connected (the process is gone) or already closed
            raise EngineDead(f"the engine process cannot be reached: {exc}") from exc

    def _send_quietly(self, message: Any) -> None:
        with contextlib.suppress(EngineDead):
            self._send(message)

    # ---- receiving (the receiver thread hands each batch to the event loop) ------------------------------
    def _receive(self) -> None:
        poller = zmq.Poller()
        poller.register(self._from_core, zmq.POLLIN)
        poller.register(self._core.sentinel, zmq.POLLIN)
        exited = False
        while not self._stopped:
            events = dict(poller.poll(LAST_WORDS_MS if exited else RECEIVE_POLL_MS))
            if self._from_core in events:
                self._heard_at = time.monotonic()
                self._post(self._deliver, self._drain())
            elif exited:  # gone, and nothing more arrived: its last words are in
                self._post(self._exited)
                return
            elif self._core.sentinel in events:
                exited = True
                poller.unregister(self._core.sentinel)

    def _drain(self) -> list[Any]:
        messages = []
        with contextlib.suppress(zmq.Again):
            while True:
                messages.append(self._receive_channel.decode(self._from_core.recv(zmq.NOBLOCK)))
        return messages

    def _post(self, fn: Callable[..., None], *args: Any) -> None:
        assert self._loop is not None
        with contextlib.suppress(RuntimeError):  # the loop has closed: nobody is left to tell
            self._loop.call_soon_threadsafe(fn, *args)

    def _deliver(self, messages: list[Any]) -> None:
        for message in messages:
            if isinstance(message, Step):
                self._step(message)
            elif isinstance(message, Dead):
                self._die(message.reason)

    def _step(self, step: Step) -> None:
        self._stats, self._accepted = step.stats, step.accepted
        for request_id, out in step.outputs:
            entry = self._open.get(request_id)
            if entry is None:
                continue
            if out.finished:
                del self._open[request_id]
            self._hand(entry[0], out)
        for result in step.results:
            future = self._commands.pop(result.id, None)
            if future is None or future.done():
                continue
            if result.error is not None:
                future.set_exception(EngineCommandError(result.error))
            else:
                future.set_result(result.value)

    @staticmethod
    def _hand(sink: Sink, out: TokenOutput) -> None:
        try:
            sink(out)
        except Exception:  # one choice's consumer failing must not starve the others
            log.exception("an output consumer failed")

    def _exited(self) -> None:
        if not self._stopped:
            self._die(f"the engine process exited unexpectedly ({self._core.describe_exit()})")

    def _die(self, reason: str) -> None:
        """The engine is gone: end every open choice and command, then tell whoever listens."""
        if self._dead is not None:
            return
        self._dead = reason
        log.error("the engine has stopped: %s", reason)
        opened, self._open = self._open, {}
        message = f"engine failure: {reason}"
        for sink, index in opened.values():
            self._hand(sink, TokenOutput(index, finished=True, finish_reason="error", error=message))
        commands, self._commands = self._commands, {}
        for future in commands.values():
            if not future.done():
                future.set_exception(EngineDead(reason))
        for callback in self._death_callbacks:
            callback(reason)
