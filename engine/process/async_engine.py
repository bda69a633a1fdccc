"""The engine loop off the asyncio event loop.

A single background thread owns the `LLMEngine` (nothing else touches its scheduler or cache): it
applies queued adds and aborts between steps, runs `step()`, hands each choice's new token ids to
the submitter's sink and, after every step, every batch of commands and every idle half second,
publishes an immutable `EngineStats` snapshot. It speaks token ids only (text is the front end's
job). Nothing waits on a stopped loop: queued work is failed when it stops.

Two users: the engine-core process (`engine.core`) drives it with sinks that batch outputs for the
front end, sent by the `on_publish` hook once per step; an in-process server uses it directly as
its `EngineClient` (`submit` delivers outputs on the caller's event loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from v4serve.engine.engine import EngineUnhealthy, LLMEngine, RequestOutput
from v4serve.engine.process.client import EngineDead, EngineOverloaded, TokenOutput, check_requests
from v4serve.engine.request import GrammarSpec, Request, RequestError
from v4serve.engine.stats import EngineStats

log = logging.getLogger(__name__)


# Threads that compile grammars before their requests join the engine (each compile holds one).
GRAMMAR_COMPILERS = 2


def public_reason(exc: BaseException) -> str:
    """What clients (and the unauthenticated /health) may read of an engine failure: the message of
    the engine's own errors, only the kind of anything else (its text stays in the log: it can hold
    anything)."""
    if isinstance(exc, (EngineDead, EngineOverloaded, EngineUnhealthy, RequestError)):
        return str(exc)
    return f"{type(exc).__name__} (the engine's log has the detail)"

__all__ = ["AsyncEngine", "EngineDead", "EngineOverloaded", "TokenOutput"]

Sink = Callable[[TokenOutput], None]


@dataclass
class _Choice:
    request: Request
    index: int
    sink: Sink
    source: int = 0  # the front end that sent it (engine core: one per API-server process)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_publish: Callable[[EngineStats], None] | None = None) -> None:
        """`on_publish` runs on the engine thread after every snapshot (the engine core sends the
        step's outputs and the snapshot to the front end from there)."""
        self.engine = engine
        self.limits = engine.limits  # frozen: requests are validated on the asyncio side
        self.max_waiting = engine.config.max_waiting
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        # What to do for each queued command if the loop ends before running it (fail its waiter).
        self._queued: dict[object, Callable[[BaseException], None]] = {}
        self._choices: dict[str, _Choice] = {}
        self._deferred: dict[str, list[_Choice]] = {}  # parent id → siblings waiting for its prefill
        self._held_back: dict[str, _Choice] = {}  # siblings whose turn came while held: they start when resumed
        # Grammars compile off the engine thread before their requests join it (`_compile_then_add`).
        self._compilers = ThreadPoolExecutor(GRAMMAR_COMPILERS, thread_name_prefix="v4serve-engine-grammar")
        self._compiling: set[str] = set()  # first choices' ids whose grammar is compiling
        self._gone: set[str] = set()  # of those, the ones aborted meanwhile
        self._lock = threading.Lock()
        self._pending = 0  # choices submitted that the loop has not yet counted in a snapshot
        self.accepted = 0  # choices the loop has taken so far, counted in the snapshots from then on
        self.accepted_from: dict[int, int] = {}  # the same by the front end that sent them
        self._on_publish = on_publish
        self._death_callbacks: list[Callable[[str], None]] = []
        self._stats = engine.stats()
        self._published_at = time.monotonic()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._ended: BaseException | None = None  # set once the loop has stopped, for whatever reason
        self._closing = False  # a graceful shutdown has begun: no new requests
        self.error: BaseException | None = None  # what killed the loop, if something did

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="v4serve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._compilers.shutdown(wait=False, cancel_futures=True)
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        # Queued SSD store writes land before exit; a step still running holds the ranks' collectives.
        self.engine.close(step_in_flight=self._thread is not None and self._thread.is_alive())

    def on_death(self, callback: Callable[[str], None]) -> None:
        """`callback(reason)` runs on the engine thread if the loop dies of an error."""
        self._death_callbacks.append(callback)

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self._ended is None and not self._closing

    def unavailable_reason(self) -> str | None:
        """Why the engine takes no requests (None while it does): for /health and 503 answers."""
        if self._closing:
            return "the server is shutting down"
        if self.error is not None:
            return f"the engine loop has stopped: {public_reason(self.error)}"
        return None if self.alive else "the engine loop is not running"

    def begin_shutdown(self, timeout: float) -> None:
        """Graceful shutdown: refuse new requests now, let running ones finish for `timeout`
        seconds, then end whatever is still open with an error (streams get an error event)."""
        self._closing = True
        timer = threading.Timer(timeout, lambda: self._submit_quietly(
            lambda: self._fail_open("the server is shutting down; the request did not finish in time")))
        timer.daemon = True
        timer.start()

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published."""
        with self._lock:
            return self._stats

    def silent_for(self) -> float:
        with self._lock:
            return time.monotonic() - self._published_at

    # ---- the asyncio side ---------------------------------------------------------------------------
    def submit(self, requests: list[Request], on_output: Sink) -> None:
        """Submit the choices of one API request (n ≥ 1, same prompt). `on_output` runs on the
        caller's event loop for every output as it arrives; each choice ends with exactly one
        finished output (stop, length, abort or error)."""
        self.check(requests)
        loop = asyncio.get_running_loop()
        self.enqueue(requests, lambda out: loop.call_soon_threadsafe(on_output, out))

    def enqueue(self, requests: list[Request], sink: Sink, source: int = 0) -> None:
        """Queue the choices of one API request without the admission check (the caller made it);
        `sink` gets every output on the engine thread; `source`: the front end that sent them
        (`accepted_from`). Choices after the first start once the first has finished its prefill, so
        they share its prompt blocks through the prefix cache."""
        choices = [_Choice(r, i, sink, source) for i, r in enumerate(requests)]

        def not_started(exc: BaseException) -> None:
            why = f"engine stopped: {public_reason(exc)}"
            for c in choices:
                c.sink(TokenOutput(c.index, finished=True, finish_reason="error", error=why))

        with self._lock:
            self._pending += len(choices)
        grammar = requests[0].sampling.grammar
        try:
            if grammar is not None and not self.engine.grammar_compiled(grammar):
                self._reserve_compile(requests[0].request_id)
                self._compilers.submit(self._compile_then_add, grammar, choices, not_started)
            else:
                self._submit(lambda: self._add(choices), not_started)
        except (EngineDead, RuntimeError):  # RuntimeError: the compilers are shut down
            with self._lock:
                self._pending -= len(choices)
            raise EngineDead(self.unavailable_reason() or "the engine loop is not running") from None

    def _reserve_compile(self, request_id: str) -> None:
        with self._lock:
            self._compiling.add(request_id)

    def _compile_then_add(self, grammar: GrammarSpec, choices: list[_Choice],
                          not_started: Callable[[BaseException], None]) -> None:
        """On a compiler thread: a grammar can take seconds to compile (a schema of thousands of
        properties), and compiled on the engine thread it would stop every running request's steps
        meanwhile. So it compiles here first; the choices then join the engine (or fail, or, if their
        client went meanwhile, end as aborted)."""
        error: Exception | None = None
        try:
            self.engine.check_grammar(grammar)
        except Exception as exc:  # noqa: BLE001 - reported as the request's error on the engine thread
            error = exc
        first = choices[0].request.request_id

        def join() -> None:
            with self._lock:
                self._compiling.discard(first)
                gone = first in self._gone
                self._gone.discard(first)
            if gone or error is not None:
                self._refuse(choices, "abort" if gone else "error", None if gone else error)
            else:
                self._add(choices)

        try:
            self._submit(join, not_started)
        except EngineDead as exc:
            not_started(exc)

    def check(self, requests: list[Request]) -> None:
        """Raise now (before any response bytes are sent) if these requests cannot be served:
        RequestError (400), EngineOverloaded (503) or EngineDead (503)."""
        reason = self.unavailable_reason()
        if reason is not None:
            raise EngineDead(reason)
        with self._lock:
            waiting = self._stats.waiting + self._pending
        check_requests(requests, self.limits, self.engine.check_grammar, waiting, self.max_waiting,
                       self._stats.fetching)

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their cache at once; each open choice ends with an
        `abort` output."""
        self._submit_quietly(lambda: self._abort(request_ids))

    def pause(self, request_ids: list[str], paused: bool) -> None:
        """Hold these requests (their client is not reading) or let them go on."""
        self._submit_quietly(lambda: self._pause(request_ids, paused))

    def _pause(self, request_ids: list[str], paused: bool) -> None:
        # A sibling not in the engine yet (waiting for its first choice's prefill, or held back since) is
        # marked, and starts only once resumed: admitted, it would take a slot and compute its prompt.
        deferred = {c.request.request_id: c.request for cs in self._deferred.values() for c in cs}
        for rid in request_ids:
            if rid in deferred:
                deferred[rid].paused = paused
            elif rid in self._held_back:
                self._held_back[rid].request.paused = paused
                if not paused:
                    self._start(self._held_back.pop(rid))
            else:
                self.engine.pause(rid, paused)

    def _submit_quietly(self, run: Callable[[], None]) -> None:
        with contextlib.suppress(EngineDead):  # a stopped loop holds nothing left to act on
            self._submit(run, lambda _: None)

    def run_on_engine(self, fn: Callable[[LLMEngine], object],
                      done: Callable[[object, BaseException | None], None]) -> None:
        """Run fn(engine) on the engine thread between steps; `done(result, error)` follows it there
        (or gets EngineDead if the loop stops first). Raises EngineDead now if it has stopped."""

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed back to the caller
                done(None, exc)
            else:
                done(result, None)

        self._submit(run, lambda exc: done(None, EngineDead(f"the engine loop has stopped: {public_reason(exc)}")))

    def call(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Run fn(engine) on the engine thread between steps (e.g. reset the prefix cache)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def settle(result: object, error: BaseException | None) -> None:
            if future.done():
                return
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(result)

        self.run_on_engine(fn, lambda result, error: loop.call_soon_threadsafe(settle, result, error))
        return future

    async def reset_prefix_cache(self, store: bool = False) -> tuple[int, int]:
        return await self.call(lambda engine: engine.reset_prefix_cache(store=store))

    async def describe(self) -> dict[str, list[str]]:
        return await self.call(lambda engine: engine.describe())  # type: ignore[return-value]

    def _submit(self, run: Callable[[], None], if_stopped: Callable[[BaseException], None]) -> None:
        """Queue a command for the engine thread. If the loop has stopped (raises EngineDead now) or
        stops before running it, `if_stopped` runs instead, so no caller ever waits on a dead loop."""
        key = object()

        def command() -> None:
            with self._lock:
                self._queued.pop(key, None)
            run()

        with self._lock:
            if self._ended is not None:
                raise EngineDead(f"the engine loop has stopped: {self._ended}")
            self._queued[key] = if_stopped
        self._commands.put(command)

    # ---- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())  # publishes a snapshot, even when idle
                if self._stop.is_set() or not self.engine.has_work():
                    continue
                for out in self.engine.step():
                    self._emit(out)
                self._publish()
        except BaseException as exc:  # the loop is dead: fail every open stream, report via /health
            log.exception("engine loop died")
            self.error = exc
            self._end(exc, f"engine failure: {public_reason(exc)}")
        else:
            self._end(EngineDead("the server is shutting down"), "the server is shutting down")
        self._last_publish()
        if self.error is not None:
            for callback in self._death_callbacks:
                callback(f"the engine loop has stopped: {public_reason(self.error)}")

    def _last_publish(self) -> None:
        """Hand out what the end produced (every open choice's error output) with a last snapshot."""
        try:
            self._publish()
        except Exception:  # a broken engine may not even count; the outputs matter more
            log.exception("the engine's last snapshot failed")
            if self._on_publish is not None:
                self._on_publish(self._stats)

    def _end(self, cause: BaseException, message: str) -> None:
        """Fail every open choice and every command still queued: nobody waits on a stopped loop."""
        with self._lock:
            self._ended = cause
            queued, self._queued = list(self._queued.values()), {}
        self._fail_open(message, abort=False)
        for if_stopped in queued:
            if_stopped(cause)

    def _fail_open(self, message: str, abort: bool = True) -> None:
        """End every open choice with an error (and, if the engine still runs, free its requests)."""
        unstarted = [c for cs in self._deferred.values() for c in cs] + list(self._held_back.values())
        for choice in list(self._choices.values()) + unstarted:
            if abort:
                self.engine.abort(choice.request.request_id)
            choice.sink(TokenOutput(choice.index, finished=True, finish_reason="error", error=message))
        self._choices.clear()
        self._deferred.clear()
        self._held_back.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            if block:  # idle: the SSD store's threads may still have moved its numbers
                self._publish()
            return
        while True:
            command()
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                break
        self._publish()

    def _publish(self, added: int = 0) -> None:
        stats = self.engine.stats()
        with self._lock:
            self._published_at = time.monotonic()
            self._stats = stats
            self._pending -= added
        if self._on_publish is not None:
            self._on_publish(stats)

    def _taken(self, choices: list[_Choice]) -> None:
        """Counted as taken: no longer in transit to the loop, whether they start or are refused."""
        self.accepted += len(choices)
        source = choices[0].source
        self.accepted_from[source] = self.accepted_from.get(source, 0) + len(choices)

    def _refuse(self, choices: list[_Choice], reason: str, error: Exception | None) -> None:
        self._taken(choices)
        param = error.param if isinstance(error, RequestError) else None
        for c in choices:
            c.sink(TokenOutput(c.index, finished=True, finish_reason=reason,
                               error=None if error is None else public_reason(error), error_param=param))
        self._publish(added=len(choices))

    def _add(self, choices: list[_Choice]) -> None:
        first, rest = choices[0], choices[1:]
        self._taken(choices)
        if self._start(first):
            if rest:
                self._deferred[first.request.request_id] = rest
        else:
            for c in rest:
                c.sink(TokenOutput(c.index, finished=True, finish_reason="error", error="not started"))
        # Counted as pending until now, as waiting (or failed) from the snapshot taken here on.
        self._publish(added=len(choices))

    def _start(self, choice: _Choice) -> bool:
        try:
            self.engine.add_request(choice.request)
        except Exception as exc:  # this request cannot start; the others are untouched
            if not isinstance(exc, RequestError):
                log.exception("request %s could not be added", choice.request.request_id)
            choice.sink(TokenOutput(choice.index, finished=True, finish_reason="error", error=public_reason(exc)))
            return False
        self._choices[choice.request.request_id] = choice
        return True

    def _abort(self, request_ids: list[str]) -> None:
        with self._lock:  # still compiling their grammar: they end once it is compiled
            self._gone.update(rid for rid in request_ids if rid in self._compiling)
        for rid in request_ids:
            for choice in (self._choices.pop(rid, None), self._held_back.pop(rid, None), *self._deferred.pop(rid, [])):
                if choice is None:
                    continue
                self.engine.abort(choice.request.request_id)
                choice.sink(TokenOutput(choice.index, finished=True, finish_reason="abort"))

    def _emit(self, out: RequestOutput) -> None:
        choice = self._choices.get(out.request_id)
        if choice is None:
            return
        for sibling in self._deferred.pop(out.request_id, []):
            if sibling.request.paused:
                self._held_back[sibling.request.request_id] = sibling
            else:
                self._start(sibling)
        request = choice.request
        first = len(request.output_token_ids) == len(out.new_token_ids)
        asked = request.sampling.prompt_logprobs is not None
        choice.sink(TokenOutput(
            choice.index, tuple(out.new_token_ids), tuple(out.samples), out.finished, out.finish_reason, out.error,
            error_param=out.error_param, num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=tuple(request.prompt_logprobs) if first and asked else None))
        if out.finished:
            self._choices.pop(out.request_id, None)
