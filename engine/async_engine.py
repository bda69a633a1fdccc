"""The engine loop off the asyncio event loop.

A single background thread owns the `LLMEngine` (nothing else touches its scheduler or cache):
it applies queued adds and aborts between steps, runs `step()`, turns sampled tokens into text
deltas (incremental detokenisation, stop strings, reasoning split) and hands them to each
request's asyncio queue. The HTTP side only awaits those queues.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

from v4serve.engine.engine import LLMEngine, RequestError, RequestOutput
from v4serve.engine.request import Request
from v4serve.engine.sampler import Sample
from v4serve.server.text.detokenizer import IncrementalDetokenizer
from v4serve.server.text.tokenizer import Tokenizer

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class EngineDead(RuntimeError):
    """The engine loop has stopped after an error."""


@dataclass(frozen=True)
class OutputOptions:
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # Thinking mode: tokens before `</think>` are reasoning, the rest content.
    reasoning_end_token: int | None = None


@dataclass
class Delta:
    """What one choice produced since its last delta."""

    index: int
    text: str = ""
    reasoning: str = ""
    token_ids: list[int] = field(default_factory=list)
    samples: list[Sample] = field(default_factory=list)
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    request: Request | None = None  # for usage accounting once finished


class EngineObserver(Protocol):
    def on_step(self, engine: LLMEngine) -> None: ...
    def on_token(self, request: Request, now: float, first: bool) -> None: ...
    def on_finish(self, request: Request, now: float) -> None: ...


@dataclass
class _Choice:
    request: Request
    index: int
    options: OutputOptions
    sink: Callable[[Delta], None]
    content: IncrementalDetokenizer
    reasoning: IncrementalDetokenizer | None
    last_token_time: float = 0.0


class AsyncEngine:
    def __init__(self, engine: LLMEngine, tokenizer: Tokenizer, observer: EngineObserver | None = None) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.observer = observer
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._choices: dict[str, _Choice] = {}
        self._deferred: dict[str, list[_Choice]] = {}  # parent id → siblings waiting for its prefill
        self._pending = 0  # submitted but not yet seen by the loop
        self._pending_lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.error: BaseException | None = None

    # ---- lifecycle ------------------------------------------------------------------------------
    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="v4serve-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(lambda: None)
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.engine.close()  # queued SSD store writes land before exit

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.error is None

    # ---- the asyncio side ---------------------------------------------------------------------------
    async def generate(self, requests: list[Request], options: OutputOptions) -> AsyncIterator[Delta]:
        """Submit the choices of one API request (n ≥ 1, same prompt) and yield their deltas.
        Choices after the first start once the first has finished its prefill, so they share
        its prompt blocks through the prefix cache."""
        self.check(requests)
        loop = asyncio.get_running_loop()
        deltas: asyncio.Queue[Delta] = asyncio.Queue()

        def sink(delta: Delta) -> None:
            loop.call_soon_threadsafe(deltas.put_nowait, delta)

        choices = [self._choice(r, i, options, sink) for i, r in enumerate(requests)]
        with self._pending_lock:
            self._pending += 1
        self._commands.put(lambda: self._add(choices))
        remaining = len(choices)
        try:
            while remaining:
                delta = await deltas.get()
                remaining -= delta.finished
                yield delta
        finally:
            if remaining:  # the consumer went away (client disconnect): free everything at once
                self.abort([r.request_id for r in requests])

    def check(self, requests: list[Request]) -> None:
        """Raise now (before any response bytes are sent) if these requests cannot be served:
        RequestError (400), EngineOverloaded (503) or EngineDead (503)."""
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        for r in requests:
            self.engine.validate(r)
        waiting = len(self.engine.scheduler.waiting) + len(self.engine.scheduler.loading) + self._pending
        if waiting + len(requests) > self.engine.scheduler.config.max_waiting:
            raise EngineOverloaded(f"{waiting} requests are already waiting")

    def abort(self, request_ids: list[str]) -> None:
        self._commands.put(lambda: self._abort(request_ids))

    def call(self, fn: Callable[[LLMEngine], object]) -> asyncio.Future:
        """Run fn(engine) on the engine thread between steps (e.g. reset the prefix cache)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def run() -> None:
            try:
                result = fn(self.engine)
            except Exception as exc:  # handed back to the caller
                loop.call_soon_threadsafe(future.set_exception, exc)
            else:
                loop.call_soon_threadsafe(future.set_result, result)

        self._commands.put(run)
        return future

    def _choice(self, request: Request, index: int, options: OutputOptions, sink: Callable[[Delta], None]) -> _Choice:
        def detok(stop: tuple[str, ...]) -> IncrementalDetokenizer:
            return IncrementalDetokenizer(self.tokenizer, skip_special_tokens=options.skip_special_tokens,
                                          stop=stop, include_stop_str_in_output=options.include_stop_str_in_output)

        reasoning = detok(()) if options.reasoning_end_token is not None else None
        return _Choice(request, index, options, sink, detok(options.stop), reasoning)

    # ---- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())
                if self._stop.is_set() or not self.engine.has_work():
                    continue
                outputs = self.engine.step()
                now = time.monotonic()
                for out in outputs:
                    self._emit(out, now)
                if self.observer is not None:
                    self.observer.on_step(self.engine)
        except BaseException as exc:  # the loop is dead: fail every open stream, report via /health
            log.exception("engine loop died")
            self.error = exc
            for choice in list(self._choices.values()) + [c for cs in self._deferred.values() for c in cs]:
                choice.sink(Delta(index=choice.index, finished=True, finish_reason="error",
                                  error=f"engine failure: {exc}", request=choice.request))
            self._choices.clear()
            self._deferred.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        command()
        while True:
            try:
                self._commands.get_nowait()()
            except queue.Empty:
                return

    def _add(self, choices: list[_Choice]) -> None:
        with self._pending_lock:
            self._pending -= 1
        first, rest = choices[0], choices[1:]
        if not self._start(first):
            for c in rest:
                c.sink(Delta(index=c.index, finished=True, finish_reason="error", error="not started",
                             request=c.request))
            return
        if rest:
            self._deferred[first.request.request_id] = rest

    def _start(self, choice: _Choice) -> bool:
        try:
            self.engine.add_request(choice.request)
        except RequestError as exc:
            choice.sink(Delta(index=choice.index, finished=True, finish_reason="error", error=str(exc),
                              request=choice.request))
            return False
        self._choices[choice.request.request_id] = choice
        return True

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            choice = self._choices.pop(rid, None)
            self._deferred.pop(rid, None)
            if self.engine.abort(rid) and choice is not None and self.observer is not None:
                choice.request.finish_reason = "abort"
                self.observer.on_finish(choice.request, time.monotonic())

    def _release_siblings(self, parent_id: str) -> None:
        for sibling in self._deferred.pop(parent_id, []):
            self._start(sibling)

    def _emit(self, out: RequestOutput, now: float) -> None:
        choice = self._choices.get(out.request_id)
        if choice is None:
            return
        request = choice.request
        self._release_siblings(out.request_id)
        delta = Delta(index=choice.index, token_ids=list(out.new_token_ids), samples=list(out.samples),
                      request=request)
        for token in out.new_token_ids:
            self._route(choice, token, delta)
        if choice.content.stopped and not out.finished:
            self.engine.finish(request, "stop")
            out.finished, out.finish_reason = True, "stop"
        if self.observer is not None:
            self.observer.on_token(request, now, first=len(request.output_token_ids) == len(out.new_token_ids))
        if out.finished:
            self._finish_text(choice, delta)
            delta.finished, delta.finish_reason = True, out.finish_reason
            self._choices.pop(out.request_id, None)
            if self.observer is not None:
                self.observer.on_finish(request, now)
        choice.sink(delta)

    def _route(self, choice: _Choice, token: int, delta: Delta) -> None:
        if choice.reasoning is not None and token == choice.options.reasoning_end_token:
            delta.reasoning += choice.reasoning.flush()
            choice.reasoning = None  # from here on, content
            return
        if choice.reasoning is not None:
            delta.reasoning += choice.reasoning.push(token)
        elif not choice.content.stopped:
            delta.text += choice.content.push(token)

    @staticmethod
    def _finish_text(choice: _Choice, delta: Delta) -> None:
        if choice.reasoning is not None:
            delta.reasoning += choice.reasoning.flush()
        if not choice.content.stopped:
            delta.text += choice.content.flush()
