"""The engine loop off the asyncio event loop.

A single background thread owns the `LLMEngine` (nothing else touches its scheduler or cache): it
applies queued adds and aborts between steps, runs `step()`, hands each choice's new token ids to
that API request's asyncio queue and, after every step and every batch of commands, publishes an
immutable `EngineStats` snapshot. The asyncio side submits requests, awaits token outputs and reads
the latest snapshot; it speaks token ids only (text is the front end's job).
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from v4serve.engine.engine import LLMEngine, RequestOutput
from v4serve.engine.request import Request, RequestError
from v4serve.engine.sampler import Sample
from v4serve.engine.stats import EngineStats

log = logging.getLogger(__name__)


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class EngineDead(RuntimeError):
    """The engine loop has stopped after an error."""


@dataclass(frozen=True)
class TokenOutput:
    """What one choice of an API request produced since its last output."""

    index: int  # the choice
    token_ids: tuple[int, ...] = ()
    samples: tuple[Sample, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # stop, length, abort or error
    error: str | None = None
    num_cached_tokens: int = 0  # prompt tokens whose computation a cache hit skipped
    prompt_logprobs: tuple | None = None  # with a choice's first output, when asked for


@dataclass
class _Choice:
    request: Request
    index: int
    sink: Callable[[TokenOutput], None]


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.limits = engine.limits  # frozen: requests are validated on the asyncio side
        self.max_waiting = engine.config.max_waiting
        self._commands: queue.Queue[Callable[[], None]] = queue.Queue()
        self._choices: dict[str, _Choice] = {}
        self._deferred: dict[str, list[_Choice]] = {}  # parent id → siblings waiting for its prefill
        self._lock = threading.Lock()
        self._pending = 0  # choices submitted that the loop has not yet counted in a snapshot
        self._stats = engine.stats()
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

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot the engine thread published."""
        with self._lock:
            return self._stats

    # ---- the asyncio side ---------------------------------------------------------------------------
    async def generate(self, requests: list[Request]) -> AsyncIterator[TokenOutput]:
        """Submit the choices of one API request (n ≥ 1, same prompt) and yield their outputs until
        every choice has finished. Choices after the first start once the first has finished its
        prefill, so they share its prompt blocks through the prefix cache."""
        self.check(requests)
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue[TokenOutput] = asyncio.Queue()

        def sink(out: TokenOutput) -> None:
            loop.call_soon_threadsafe(outputs.put_nowait, out)

        choices = [_Choice(r, i, sink) for i, r in enumerate(requests)]
        with self._lock:
            self._pending += len(choices)
        self._commands.put(lambda: self._add(choices))
        remaining = len(choices)
        try:
            while remaining:
                out = await outputs.get()
                remaining -= out.finished
                yield out
        finally:
            if remaining:  # the consumer went away (client disconnect): free everything at once
                self.abort([r.request_id for r in requests])

    def check(self, requests: list[Request]) -> None:
        """Raise now (before any response bytes are sent) if these requests cannot be served:
        RequestError (400), EngineOverloaded (503) or EngineDead (503)."""
        if not self.alive:
            raise EngineDead("the engine loop is not running")
        for r in requests:
            self.limits.validate(r)
        with self._lock:
            waiting = self._stats.waiting + self._pending
        if waiting + len(requests) > self.max_waiting:
            raise EngineOverloaded(f"{waiting} requests are already waiting")

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their cache at once; each open choice ends with an
        `abort` output."""
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

    # ---- the engine thread ----------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_work())
                if self._stop.is_set() or not self.engine.has_work():
                    continue
                for out in self.engine.step():
                    self._emit(out)
                self._publish()
        except BaseException as exc:  # the loop is dead: fail every open stream, report via /health
            log.exception("engine loop died")
            self.error = exc
            for choice in list(self._choices.values()) + [c for cs in self._deferred.values() for c in cs]:
                choice.sink(TokenOutput(choice.index, finished=True, finish_reason="error",
                                        error=f"engine failure: {exc}"))
            self._choices.clear()
            self._deferred.clear()

    def _drain(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
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
            self._stats = stats
            self._pending -= added

    def _add(self, choices: list[_Choice]) -> None:
        first, rest = choices[0], choices[1:]
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
        except RequestError as exc:
            choice.sink(TokenOutput(choice.index, finished=True, finish_reason="error", error=str(exc)))
            return False
        self._choices[choice.request.request_id] = choice
        return True

    def _abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for choice in (self._choices.pop(rid, None), *self._deferred.pop(rid, [])):
                if choice is None:
                    continue
                self.engine.abort(choice.request.request_id)
                choice.sink(TokenOutput(choice.index, finished=True, finish_reason="abort"))

    def _emit(self, out: RequestOutput) -> None:
        choice = self._choices.get(out.request_id)
        if choice is None:
            return
        for sibling in self._deferred.pop(out.request_id, []):
            self._start(sibling)
        request = choice.request
        first = len(request.output_token_ids) == len(out.new_token_ids)
        asked = request.sampling.prompt_logprobs is not None
        choice.sink(TokenOutput(
            choice.index, tuple(out.new_token_ids), tuple(out.samples), out.finished, out.finish_reason,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=tuple(request.prompt_logprobs) if first and asked else None))
        if out.finished:
            self._choices.pop(out.request_id, None)
