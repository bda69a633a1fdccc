"""Build and run the daemon from one frozen config.

The HTTP front end runs here; the engine (scheduler, KV cache, SSD store, model) runs in an
engine-core process started at once, which loads the model while the front end gets ready
(`--engine-in-process` keeps it on a thread of this process instead, for benchmarks and debugging).
If the engine stops by itself, the daemon answers 503 for a moment and exits non-zero, so a service
manager restarts it.
"""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from v4serve.engine.process.client import EngineClient
from v4serve.engine.process.core_client import EngineCoreClient
from v4serve.server.app import build_app
from v4serve.server.config import DEFAULT_STORE_BYTES, ServeConfig, check_parallel_flags, launched_rank
from v4serve.server.engine_process import EngineSpec, main
from v4serve.server.generation import ServerConfig
from v4serve.server.metrics import Metrics
from v4serve.server.text.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["EngineFailed", "GracefulServer", "ServeConfig", "build", "run"]

log = logging.getLogger("v4serve")

# After the engine stops by itself: seconds /health and new requests get 503 with the cause (so a
# load balancer sees why) before the daemon exits.
ENGINE_DEATH_GRACE = 2.0


class EngineFailed(RuntimeError):
    """The engine stopped while serving; the daemon exits non-zero."""


def load_front_tokenizer(cfg: ServeConfig) -> Tokenizer:
    if cfg.model == "tiny":
        return ByteTokenizer()
    folder = Path(cfg.model)
    if not folder.is_dir():
        raise ValueError(f"--model must be 'tiny' or a checkpoint folder; {folder} is not a folder")
    return load_tokenizer(folder)


def start_engine(cfg: ServeConfig, tokenizer: Tokenizer) -> tuple[EngineClient, dict[str, Any]]:
    """The engine (loaded and ready) and what it reports of itself."""
    check_parallel_flags(cfg, launched_rank())
    if cfg.engine_in_process:
        from v4serve.engine.process.async_engine import AsyncEngine
        from v4serve.server.model_loading import build_engine

        engine, info = build_engine(cfg, tokenizer.vocabulary_json(), tokenizer.eos_token_id)
        return AsyncEngine(engine), info
    vocabulary = tokenizer.vocabulary_json()
    client = EngineCoreClient(main, EngineSpec(cfg, vocabulary, tokenizer.eos_token_id), vocabulary,
                              tokenizer.eos_token_id)
    client.wait_ready()
    return client, client.info


def build(cfg: ServeConfig) -> tuple[FastAPI, EngineClient]:
    tokenizer = load_front_tokenizer(cfg)
    engine, info = start_engine(cfg, tokenizer)
    try:
        store_on = not (cfg.no_kv_store or cfg.no_prefix_caching)
        metrics = Metrics(cfg.model_name, lambda: engine.stats,
                          store_capacity_bytes=(cfg.kv_store_max_bytes or DEFAULT_STORE_BYTES) if store_on else 0,
                          healthy=lambda: engine.unavailable_reason() is None)
        server = ServerConfig(cfg.model_name, info["max_model_len"], api_key=cfg.api_key,
                              protect_metrics=cfg.protect_metrics, max_request_bytes=cfg.max_request_bytes,
                              version_info=info["version_info"])
        return build_app(engine, tokenizer, server, metrics), engine
    except BaseException:
        engine.shutdown()
        raise


# Seconds uvicorn waits beyond --shutdown-timeout: time for the streams ended then to send their last
# events before it cuts what is left.
_SHUTDOWN_MARGIN = 5.0


class GracefulServer(uvicorn.Server):
    """On SIGTERM (or Ctrl-C): uvicorn stops accepting connections; running requests get
    `shutdown_timeout` seconds to finish, then the engine ends the rest with an error, so every
    stream still closes with an error event and [DONE]; queued SSD-store writes are flushed at exit.
    If the engine stops by itself, the server exits after `ENGINE_DEATH_GRACE` seconds."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.engine, self.shutdown_timeout = engine, shutdown_timeout
        self.engine_failure: str | None = None
        engine.on_death(self._engine_died)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit:
            log.info("shutting down: running requests have %.0f s to finish", self.shutdown_timeout)
            self.engine.begin_shutdown(self.shutdown_timeout)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once shut down, which would end the process with it: a
        # completed graceful shutdown exits 0 instead (what Docker and Kubernetes expect).
        self._captured_signals.clear()

    def _engine_died(self, reason: str) -> None:
        """From any thread: uvicorn polls should_exit."""
        self.engine_failure = reason
        log.error("the engine has stopped (%s); exiting in %.0f s", reason, ENGINE_DEATH_GRACE)
        timer = threading.Timer(ENGINE_DEATH_GRACE, lambda: setattr(self, "should_exit", True))
        timer.daemon = True
        timer.start()


def run(cfg: ServeConfig) -> None:
    app, engine = build(cfg)
    try:
        shown = "127.0.0.1" if cfg.host in ("0.0.0.0", "::") else cfg.host
        log.info("serving %s at http://%s:%d/v1 (OpenAI-compatible; /health, /metrics)", cfg.model_name, shown,
                 cfg.port)
        config = uvicorn.Config(app, host=cfg.host, port=cfg.port, log_level=cfg.log_level,
                                timeout_graceful_shutdown=cfg.shutdown_timeout + _SHUTDOWN_MARGIN)
        server = GracefulServer(config, engine, cfg.shutdown_timeout)
        server.run()
    finally:
        engine.shutdown()  # idempotent: normally the app's lifespan has done it
    if server.engine_failure is not None:
        raise EngineFailed(server.engine_failure)
