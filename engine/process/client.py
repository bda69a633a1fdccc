"""What the front end sees of an engine, wherever the engine runs.

Token outputs, the reasons an engine refuses work, and `EngineClient`: the one surface the HTTP
side uses, offered both by the engine thread of an in-process engine (`async_engine.AsyncEngine`)
and by the client of the engine-core process (`core_client.EngineCoreClient`). This module imports
no torch, so neither does a front end that runs its engine in another process.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from v4serve.engine.request import GrammarSpec, Request, RequestLimits, Sample
from v4serve.engine.stats import EngineStats


class EngineOverloaded(RuntimeError):
    """The waiting queue is full; the client should retry later."""


class EngineDead(RuntimeError):
    """The engine has stopped (an error, a dead process, or a shutdown)."""


@dataclass(frozen=True)
class TokenOutput:
    """What one choice of an API request produced since its last output."""

    index: int  # the choice
    token_ids: tuple[int, ...] = ()
    samples: tuple[Sample, ...] = ()
    finished: bool = False
    finish_reason: str | None = None  # stop, length, abort or error
    error: str | None = None
    error_param: str | None = None  # the request's field that caused the error (a 400), if it did
    num_cached_tokens: int = 0  # prompt tokens whose computation a cache hit skipped
    prompt_logprobs: tuple[Sample | None, ...] | None = None  # with a choice's first output, when asked for


class EngineClient(Protocol):
    """What the server needs from an engine. Every method is called on the server's event loop,
    except `begin_shutdown` (from a signal handler) and `shutdown` (after the loop has served)."""

    limits: RequestLimits  # frozen: requests are validated in the front end, before a stream's first byte

    def start(self) -> None:
        """Begin delivering outputs (called on the running event loop)."""

    def shutdown(self) -> None:
        """Stop the engine; queued SSD-store writes land first. Idempotent."""

    @property
    def alive(self) -> bool: ...

    def silent_for(self) -> float:
        """Seconds since the engine was last heard from. It publishes after every step and every idle
        half second, so this grows only while a step is stuck (or the process is stopped)."""

    def unavailable_reason(self) -> str | None:
        """Why the engine takes no requests (None while it does): for /health and 503 answers."""

    def begin_shutdown(self, timeout: float) -> None:
        """Refuse new requests now; end whatever still runs after `timeout` seconds with an error."""

    @property
    def stats(self) -> EngineStats:
        """The latest snapshot the engine published."""

    def check(self, requests: list[Request]) -> None:
        """Raise RequestError (400), EngineOverloaded or EngineDead (503) if these cannot be served."""

    def submit(self, requests: list[Request], on_output: Callable[[TokenOutput], None]) -> None:
        """Start the choices of one API request; `on_output` runs on the event loop for each output,
        and each choice ends with exactly one finished output."""

    def abort(self, request_ids: list[str]) -> None:
        """Stop these requests and free their cache at once."""

    def pause(self, request_ids: list[str], paused: bool) -> None:
        """Hold these requests, whose client is not reading (the engine stops scheduling them; they
        keep their cache), or let them go on."""

    async def reset_prefix_cache(self, store: bool = False) -> tuple[int, int]:
        """Forget unreferenced cached blocks (and the SSD store's files with `store`) →
        (blocks dropped, store files removed)."""

    async def describe(self) -> dict[str, list[str]]:
        """The engine's queues, each request in words (`LLMEngine.describe`), taken between steps."""

    def on_death(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once, from any thread, if the engine stops by itself."""


def check_requests(requests: list[Request], limits: RequestLimits, check_grammar: Callable[[GrammarSpec], None],
                   waiting: int, max_waiting: int, fetching: int = 0) -> None:
    """The admission check both engines make before a response starts: RequestError for a request
    the engine cannot serve, EngineOverloaded when the waiting queue would overflow. Requests waiting
    for a hand-over fetch (a decode replica's) have an allowance of their own, as large: a slow
    producer can fill that, never the queue everyone else waits in."""
    for r in requests:
        limits.validate(r)
        if r.sampling.grammar is not None:
            check_grammar(r.sampling.grammar)
    fetches = sum(r.kv_source is not None for r in requests)
    if waiting + len(requests) - fetches > max_waiting:
        raise EngineOverloaded(f"{waiting} requests are already waiting")
    if fetches and fetching + fetches > max_waiting:
        raise EngineOverloaded(f"{fetching} requests are already waiting for their hand-over to be fetched")
