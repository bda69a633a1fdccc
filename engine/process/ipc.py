"""The messages between the front end and the engine-core process, and their msgpack framing.

Token ids, sampling parameters (a structured-output grammar travels as its text, `GrammarSpec`),
token outputs and stats snapshots: never text to tokenize. Each message is one msgspec Struct,
tagged by its class name, in one ZeroMQ frame; each front end (one per API-server process) binds its
two sockets in a private folder (mode 0700: only this user can connect), the engine core connects to
every front end's. A message never names the front end it came from: the socket it arrived on does.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import msgspec

from v4serve.cache.kv_transfer import KVSource
from v4serve.engine.process.client import TokenOutput
from v4serve.engine.request import Request, RequestLimits, SamplingParams
from v4serve.engine.stats import EngineStats

PROCESS_NAME = "v4serve-engine"  # the engine process's name in ps -o comm, top and /proc/PID/comm


@dataclass(frozen=True)
class CoreAddresses:
    """Where the engine core meets its front ends: front end i binds `inputs[i]` and `outputs[i]`."""

    inputs: tuple[str, ...]  # front end → engine core (PUSH → PULL)
    outputs: tuple[str, ...]  # engine core → front end (PUSH → PULL)

    @classmethod
    def in_folder(cls, folder: str, fronts: int) -> CoreAddresses:
        return cls(tuple(f"ipc://{folder}/in{i}" for i in range(fronts)),
                   tuple(f"ipc://{folder}/out{i}" for i in range(fronts)))

    def front(self, index: int) -> CoreAddresses:
        """Front end `index`'s own pair."""
        return CoreAddresses((self.inputs[index],), (self.outputs[index],))


# ---- front end → engine core ------------------------------------------------------------------------
class WireRequest(msgspec.Struct, array_like=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str | None
    arrival_time: float  # CLOCK_MONOTONIC: one clock for every process of the machine
    swa_cache_mode: str | None = None
    handover: str | None = None
    kv_source: KVSource | None = None

    @classmethod
    def of(cls, r: Request) -> WireRequest:
        return cls(r.request_id, r.prompt_token_ids, r.sampling, r.cache_salt, r.arrival_time, r.swa_cache_mode,
                   r.handover, r.kv_source)

    def request(self) -> Request:
        return Request(self.request_id, self.prompt_token_ids, self.sampling, cache_salt=self.cache_salt,
                       arrival_time=self.arrival_time, swa_cache_mode=self.swa_cache_mode, handover=self.handover,
                       kv_source=self.kv_source)


class Submit(msgspec.Struct, tag=True, array_like=True):
    """The choices of one API request, in choice order."""

    requests: list[WireRequest]


class Abort(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]


class Pause(msgspec.Struct, tag=True, array_like=True):
    request_ids: list[str]
    paused: bool


class Command(msgspec.Struct, tag=True, array_like=True):
    """A named engine operation run between steps (`engine.core.COMMANDS`); answered by a
    `CommandResult` with the same id."""

    id: int
    name: str
    kwargs: dict[str, Any]


class BeginShutdown(msgspec.Struct, tag=True, array_like=True):
    timeout: float


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    pass


ToCore = Submit | Abort | Pause | Command | BeginShutdown | Shutdown


# ---- engine core → front end ------------------------------------------------------------------------
class Ready(msgspec.Struct, tag=True, array_like=True):
    limits: RequestLimits
    max_waiting: int
    info: dict[str, Any]  # what the builder reports (the server's /version fields, max_model_len)
    stats: EngineStats
    pid: int


class StartupFailed(msgspec.Struct, tag=True, array_like=True):
    message: str
    invalid_config: bool  # a bad flag or folder (exit status 2), not a fault while loading


class CommandResult(msgspec.Struct, array_like=True):
    id: int
    value: Any
    error: str | None


class Step(msgspec.Struct, tag=True, array_like=True):
    """Everything one engine step (or one batch of commands) produced, with the snapshot after it."""

    outputs: list[tuple[str, TokenOutput]]  # (choice request id, its output)
    results: list[CommandResult]
    stats: EngineStats
    accepted: int  # this front end's choices the engine has taken so far: the rest it sent still count as waiting


class Dead(msgspec.Struct, tag=True, array_like=True):
    """The engine loop has died; the process exits next."""

    reason: str


FromCore = Ready | StartupFailed | Step | Dead


def _encode_extra(obj: Any) -> Any:
    """msgspec's `enc_hook`: convert what msgpack cannot carry as is. Raising NotImplementedError is
    msgspec's protocol for "unsupported type" (it reports it as a TypeError naming the type)."""
    if isinstance(obj, MappingProxyType):  # the snapshots' read-only mappings
        return dict(obj)
    raise NotImplementedError(f"cannot send {type(obj).__name__} to the other process")


class Channel:
    """Encoder and decoder of one direction's messages (one per thread that uses them)."""

    def __init__(self, incoming: Any) -> None:
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)
        self._decoder = msgspec.msgpack.Decoder(incoming)

    def encode(self, message: msgspec.Struct) -> bytes:
        return self._encoder.encode(message)

    def decode(self, frame: bytes | memoryview) -> Any:
        return self._decoder.decode(frame)
