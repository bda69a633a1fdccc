"""Build and run the daemon from one frozen config.

The HTTP front end runs here; the engine (scheduler, KV cache, SSD store, model) runs in an
engine-core process started at once, which loads the model while the front end gets ready
(`--engine-in-process` keeps it on a thread of this process instead, for benchmarks and debugging).
If the engine stops by itself, the daemon answers 503 for a moment and exits non-zero, so a service
manager restarts it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import errno
import ipaddress
import logging
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

import uvicorn
from fastapi import FastAPI

from v4serve.engine.process.client import EngineClient
from v4serve.engine.process.core_client import EngineCoreClient
from v4serve.engine.process.lifecycle import freeze_startup_objects, name_process
from v4serve.server.api_servers import PROCESS_NAME as API_SERVER_NAME
from v4serve.server.api_servers import ApiServers, ApiServerSpec, SharedFolder
from v4serve.server.app import build_app
from v4serve.server.config import (
    DEFAULT_STORE_BYTES,
    LOG_FORMAT,
    REQUEST_TOKENS_PER_CONTEXT,
    ServeConfig,
    check_parallel_flags,
    default_store_dir,
    is_embedded,
    launched_rank,
)
from v4serve.server.connections import protocol_with_header_timeout
from v4serve.server.engine_process import EngineSpec, main
from v4serve.server.generation import ServerConfig
from v4serve.server.handover import Handovers, PendingHandovers
from v4serve.server.metrics import Metrics, use_multiprocess_values
from v4serve.server.preprocess import PreprocessConfig, Preprocessor
from v4serve.server.text.chat_encoding import missing_specials, prompt_format_of
from v4serve.server.text.tokenizer import Tokenizer, embedded_tokenizer, input_only_ids, load_tokenizer

__all__ = ["EngineFailed", "GracefulServer", "PortUnavailable", "ServeConfig", "bind_sockets", "build", "run",
           "served_url"]

log = logging.getLogger("v4serve")

# After the engine stops by itself: seconds /health and new requests get 503 with the cause (so a
# load balancer sees why) before the daemon exits.
ENGINE_DEATH_GRACE = 2.0


class EngineFailed(RuntimeError):
    """The engine stopped while serving; the daemon exits non-zero."""


def load_front_tokenizer(cfg: ServeConfig) -> Tokenizer:
    if is_embedded(cfg.model):
        return embedded_tokenizer(cfg.model)
    folder = Path(cfg.model)
    if not folder.is_dir():
        raise ValueError(f"--model must be 'tiny', 'tiny-v41' or a checkpoint folder; {folder} is not a folder")
    tokenizer = load_tokenizer(folder)
    fmt = prompt_format_of(tokenizer)
    missing, some = missing_specials(tokenizer, fmt)
    if missing:
        raise ValueError(f"{folder / 'tokenizer.json'} has no token {missing[0]!r}, which the {fmt.name} prompt format "
                         f"writes (missing: {', '.join(missing)}); the checkpoint's own tokenizer.json is needed")
    if some:
        log.warning("%s has no token for %s: the %s prompt format writes them as their characters (tool calls or "
                    "what needs them will not read as the model was trained)", folder / "tokenizer.json",
                    ", ".join(some), fmt.name)
    return tokenizer


def start_engine(cfg: ServeConfig, tokenizer: Tokenizer) -> tuple[EngineClient, dict[str, Any]]:
    """The engine (loaded and ready) and what it reports of itself."""
    check_parallel_flags(cfg, launched_rank())
    if cfg.engine_in_process:
        from v4serve.engine.process.async_engine import AsyncEngine
        from v4serve.server.model_loading import build_engine

        engine, info = build_engine(cfg, tokenizer.vocabulary_json(), tokenizer.eos_token_id,
                                    input_only_ids(tokenizer))
        return AsyncEngine(engine), info
    vocabulary = tokenizer.vocabulary_json()
    spec = EngineSpec(cfg, vocabulary, tokenizer.eos_token_id, input_only_ids(tokenizer))
    client = EngineCoreClient(main, spec, vocabulary,
                              tokenizer.eos_token_id, cfg.grammar_cache_bytes, api_servers=cfg.api_server_count)
    client.wait_ready()
    return client, client.info


def build(cfg: ServeConfig, tokenizer: Tokenizer | None = None,
          shared: SharedFolder | None = None) -> tuple[FastAPI, EngineClient]:
    """The first (or only) API server's app, and the engine it starts. `shared`: what several API
    servers share (None: one)."""
    if tokenizer is None:
        tokenizer = load_front_tokenizer(cfg)
    # Workers start (each loads the tokenizer) while the engine loads its model.
    prep = Preprocessor(tokenizer, PreprocessConfig(cfg.preprocess_workers, cfg.max_preprocess_seconds, cfg.model))
    prep.start()
    try:
        engine, info = start_engine(cfg, tokenizer)
    except BaseException:
        prep.close()
        raise
    try:
        return front_app(cfg, tokenizer, engine, info, prep, shared), engine
    except BaseException:
        engine.shutdown()
        prep.close()
        raise


def front_app(cfg: ServeConfig, tokenizer: Tokenizer, engine: EngineClient, info: dict[str, Any],
              prep: Preprocessor, shared: SharedFolder | None = None, index: int = 0,
              created: int | None = None) -> FastAPI:
    """One API server's app over a ready engine: API server `index` of `cfg.api_server_count`."""
    keys = cfg.api_keys()
    if keys is not None and keys.isolating and index == 0:
        log.info("API keys: %d tenants from %s, %s (read again on SIGHUP or change)", len(keys.tenants),
                 cfg.api_keys_file, "sharing one prefix cache" if cfg.shared_prefix_cache
                 else "each with a prefix cache of its own")
        if not cfg.protect_metrics:
            log.warning("/metrics answers without a key and shows each tenant's name and token counts; "
                        "--protect-metrics requires a key there too")
    store_on = not (cfg.no_kv_store or cfg.no_prefix_caching)
    metrics = Metrics(cfg.model_name, lambda: engine.stats,
                      store_capacity_bytes=(cfg.kv_store_max_bytes or DEFAULT_STORE_BYTES) if store_on else 0,
                      healthy=lambda: engine.unavailable_reason() is None,
                      cache_info=info.get("cache_info"), tenants=keys.tenants if keys else (),
                      multiprocess_dir=shared.metrics if shared else None)
    server = ServerConfig(cfg.model_name, info["max_model_len"], aliases=cfg.model_names[1:], keys=keys,
                          isolate_tenants=keys is not None and keys.isolating and not cfg.shared_prefix_cache,
                          swa_cache_mode=cfg.swa_cache_mode, default_thinking=cfg.default_thinking,
                          protect_metrics=cfg.protect_metrics, max_request_bytes=cfg.max_request_bytes,
                          max_unread_tokens=cfg.max_unread_tokens, max_logprob_entries=cfg.max_logprob_entries,
                          unread_timeout=cfg.unread_timeout,
                          max_request_tokens=cfg.max_request_tokens
                          or REQUEST_TOKENS_PER_CONTEXT * info["max_model_len"],
                          responses_store_bytes=cfg.responses_store_bytes,
                          responses_folder=shared.responses if shared else None,
                          api_server=(index, cfg.api_server_count), max_requests=cfg.max_connections,
                          allowed_origins=cfg.origins,
                          stall_timeout=cfg.stall_timeout, unknown_fields=cfg.unknown_fields,
                          stream_keepalive=cfg.stream_keepalive,
                          version_info=info["version_info"], handovers=handovers(cfg, shared),
                          **({"created": created} if created else {}))
    return build_app(engine, tokenizer, server, metrics, prep)


def handovers(cfg: ServeConfig, shared: SharedFolder | None = None) -> Handovers | None:
    """This replica's role with prefill and decode apart, and where its hand-overs are (None: neither)."""
    transfer = cfg.kv_transfer
    if transfer is None:
        return None
    host, port = cfg.kv_transfer_address(transfer)
    pending = PendingHandovers(Path(shared.handovers) if shared else None, transfer.hold_seconds)
    return Handovers(transfer, Path(cfg.kv_store_dir or default_store_dir()), host, port, pending)


def uvicorn_config(cfg: ServeConfig, app: FastAPI, port: int) -> uvicorn.Config:
    metrics = app.state.front.metrics
    return uvicorn.Config(app, host=cfg.host, port=port, log_level=cfg.log_level,
                          timeout_graceful_shutdown=cfg.shutdown_timeout + SHUTDOWN_MARGIN,
                          timeout_keep_alive=cfg.keep_alive_timeout,
                          http=protocol_with_header_timeout(cfg.header_timeout, metrics.count_closed,
                                                            cfg.max_connections, cfg.h11_max_incomplete_event_size,
                                                            cfg.h11_max_header_count))


# Seconds the engine has to list its requests for SIGUSR1's dump (it answers between steps).
DESCRIBE_TIMEOUT = 10.0

# Seconds uvicorn waits beyond --shutdown-timeout: time for the streams ended then to send their last
# events before it cuts what is left.
SHUTDOWN_MARGIN = 5.0


class GracefulServer(uvicorn.Server):
    """On SIGTERM (or Ctrl-C): uvicorn stops accepting connections; running requests get
    `shutdown_timeout` seconds to finish, then the engine ends the rest with an error, so every
    stream still closes with an error event and [DONE]; queued SSD-store writes are flushed at exit.
    If the engine stops by itself, the server exits after `ENGINE_DEATH_GRACE` seconds.

    Other signals whose default would end the daemon: SIGHUP reads --api-keys-file again and changes
    nothing else (every other setting is read at start), SIGUSR1 logs the engine's state and requests,
    SIGUSR2 is logged and ignored; `run` ignores all three from the start, so one that comes while the model loads is
    harmless too. SIGPIPE is ignored by Python itself; SIGQUIT keeps its default (a core dump, asked
    for on purpose); nothing else is sent to a daemon in the normal course of things."""

    def __init__(self, config: uvicorn.Config, engine: EngineClient, shutdown_timeout: float,
                 watchdog_timeout: float = 0.0, abandon_engine: Callable[[str], None] | None = None,
                 others: ApiServers | None = None, follower: bool = False) -> None:
        """`others`: the API servers this one started (SIGTERM and SIGHUP are passed on to them);
        `follower`: an API server the first one started, which passes stops on as SIGTERM (so a
        terminal's Ctrl-C, which reaches every process of the group, is left to it)."""
        super().__init__(config)
        self.engine, self.shutdown_timeout, self.watchdog_timeout = engine, shutdown_timeout, watchdog_timeout
        self.abandon_engine = abandon_engine
        self.others, self.follower = others, follower
        self.engine_failure: str | None = None
        engine.on_death(self._engine_died)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.follower and sig == signal.SIGINT:
            return
        if not self.should_exit:
            if not self.follower:
                log.info("shutting down: running requests have %.0f s to finish", self.shutdown_timeout)
            self.engine.begin_shutdown(self.shutdown_timeout)
            if self.others is not None:
                self.others.signal(signal.SIGTERM)
        super().handle_exit(sig, frame)
        # uvicorn re-raises the signal once shut down, which would end the process with it: a
        # completed graceful shutdown exits 0 instead (what Docker and Kubernetes expect).
        self._captured_signals.clear()

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        loop.add_signal_handler(signal.SIGUSR1, lambda: loop.create_task(self.dump_state()))
        loop.add_signal_handler(signal.SIGUSR2, log.info, "SIGUSR2 ignored (SIGUSR1 dumps the engine state)")
        if self.watchdog_timeout:
            threading.Thread(target=self._watchdog, name="v4serve-watchdog", daemon=True).start()

    def _reload(self) -> None:
        if self.others is not None:
            self.others.signal(signal.SIGHUP)
        keys = getattr(self.config.app.state.front.config, "keys", None)
        if keys is not None and keys.keys_file is not None:
            log.info("SIGHUP: reading %s again", keys.keys_file)
            threading.Thread(target=keys.reload, name="v4serve-keys-reload", daemon=True).start()  # off the loop
        else:
            log.info("SIGHUP: nothing to reload (settings are read at start; --api-keys-file is read again on "
                     "SIGHUP); still serving")

    def _watchdog(self) -> None:
        """A thread, so a stuck event loop cannot hide a stuck engine: once the engine has been silent
        for --watchdog-timeout, the daemon exits 1 and its service manager restarts it (a step stuck
        on a hung GPU or collective never finishes by itself)."""
        while not self.should_exit:
            silent = self.engine.silent_for()
            if silent > self.watchdog_timeout:
                reason = (f"the engine has not finished a step for {silent:.0f} s "
                          f"(--watchdog-timeout {self.watchdog_timeout:g})")
                self._engine_died(reason)
                if self.abandon_engine is not None:  # its open requests end with that error at once
                    self.abandon_engine(reason)
                return
            time.sleep(min(1.0, self.watchdog_timeout / 4))

    async def dump_state(self) -> None:
        """SIGUSR1: the engine's numbers and every queued and running request, to the log."""
        s = self.engine.stats
        log.info("state (SIGUSR1): %d running, %d waiting; State Cache %.0f%%, Block Cache %.0f%% used; "
                 "SSD store %.1f MiB, %d quarantined files; engine: %s", s.running, s.waiting,
                 100 * s.state_cache_usage, 100 * s.block_cache_usage, s.store_usage_bytes / 2**20,
                 s.store_quarantine_files, self.engine.unavailable_reason() or "serving")
        try:
            queues = await asyncio.wait_for(self.engine.describe(), DESCRIBE_TIMEOUT)
        except Exception as exc:  # a dump must never take the daemon down
            log.info("state: the engine did not list its requests within %.0f s (%r)", DESCRIBE_TIMEOUT, exc)
            return
        for queue, lines in queues.items():
            for line in lines:
                log.info("state: %s %s", queue, line)

    def _engine_died(self, reason: str) -> None:
        """From any thread: uvicorn polls should_exit. The first cause is the one reported."""
        self.failed(reason, f"the engine has stopped ({reason})")

    def failed(self, reason: str, said: str | None = None, grace: float = ENGINE_DEATH_GRACE) -> None:
        """The daemon cannot go on (the engine, or another API server, has stopped): it exits
        non-zero after `grace` seconds. From any thread."""
        if self.engine_failure is not None:
            return
        self.engine_failure = reason
        log.error("%s; exiting in %.0f s", said or reason, grace)
        timer = threading.Timer(grace, lambda: setattr(self, "should_exit", True))
        timer.daemon = True
        timer.start()

    def api_server_failed(self, reason: str) -> None:
        """Another API server exited unasked (from the thread that saw it): the engine still runs, so the
        daemon shuts down as on SIGTERM, decided now. /health and new requests answer 503 from this
        moment; running requests, this process's and the other API servers', get --shutdown-timeout and
        then end with an error (each stream an error event and [DONE]); the port closes once they have."""
        if self.engine_failure is not None:
            return
        self.engine.begin_shutdown(self.shutdown_timeout)
        if self.others is not None:
            self.others.signal(signal.SIGTERM)
        self.failed(reason, f"{reason}: shutting down (running requests have {self.shutdown_timeout:.0f} s)",
                    self.shutdown_timeout + ENGINE_DEATH_GRACE)


class PortUnavailable(OSError):
    """The daemon cannot listen where it was told to (a port in use, a privileged port, an address
    not of this machine): a bad setting, so `v4serve serve` exits 2."""


# Addresses to which any local client can connect, for the wildcard ones in the log.
_LOOPBACK = {"0.0.0.0": "127.0.0.1", "::": "::1"}


def bind_sockets(host: str, port: int, attempts: int = 5) -> list[socket.socket]:
    """Sockets bound to every address `host` names (one for 0.0.0.0 or ::, both 127.0.0.1 and ::1
    for localhost), on `port`, or with port 0 on one free port the system picks for all of them.

    Bound, not yet listening: until the engine is ready, a client's connection is refused (not left
    waiting), yet no outgoing connection's ephemeral port, no port another process has the system
    pick, and no server already listening there can have the port meanwhile (only one that, as this
    does, sets SO_REUSEADDR and binds this very port can listen first; then `listen` fails, naming
    it). A port the system picks as it binds can't be taken between choosing and binding it, as a
    port looked up free and bound later can (any outgoing connection takes an ephemeral port from the
    same range)."""
    try:
        infos = socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise PortUnavailable(f"cannot listen on --host {host!r}: {exc.strerror}") from None
    addresses = list(dict.fromkeys((family, address[:2]) for family, _, _, _, address in infos))
    for attempt in range(attempts):
        sockets: list[socket.socket] = []
        try:
            for family, (addr, want) in addresses:
                sock = socket.socket(family, socket.SOCK_STREAM)
                sockets.append(sock)
                # A restarted daemon can bind while the last one's connections linger in TIME_WAIT
                # (a port some process listens on is still refused).
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:  # "::" is IPv6 only, as uvicorn and asyncio bind it
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                # With port 0, every address after the first takes the port the first one got.
                sock.bind((addr, want if want or len(sockets) == 1 else sockets[0].getsockname()[1]))
            return sockets
        except OSError as exc:
            for sock in sockets:
                sock.close()
            chosen = port == 0 and len(sockets) > 1  # the system's port, free on one address, not another
            if exc.errno == errno.EADDRINUSE and chosen and attempt + 1 < attempts:
                continue
            raise _unavailable(host, port, exc) from None
    raise AssertionError("not reached: the last attempt returns or raises")


def listen(sockets: list[socket.socket], host: str, backlog: int) -> None:
    """Start accepting connections (before uvicorn runs, so the logged address answers at once)."""
    for sock in sockets:
        try:
            sock.listen(backlog)
        except OSError as exc:  # another daemon, also starting, bound the port too and listens first
            raise _unavailable(host, sock.getsockname()[1], exc) from None


def _unavailable(host: str, port: int, exc: OSError) -> PortUnavailable:
    where = f"{host or '*'} port {port}"
    if exc.errno == errno.EADDRINUSE:
        why = "address already in use (another process listens there: stop it, or choose another --port)"
    elif exc.errno == errno.EACCES:
        why = "permission denied (ports below 1024 need root or CAP_NET_BIND_SERVICE)"
    elif exc.errno == errno.EADDRNOTAVAIL:
        why = "no such address on this machine (--host must be one of its addresses, 0.0.0.0 or ::)"
    else:
        why = exc.strerror or str(exc)
    return PortUnavailable(f"cannot listen on {where}: {why}")


def served_url(sock: socket.socket) -> str:
    """http://HOST:PORT a local client reaches the bound `sock` at."""
    host, port = sock.getsockname()[:2]
    host = _LOOPBACK.get(host, host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def warn_if_open(cfg: ServeConfig, sockets: list[socket.socket]) -> None:
    """Anyone who can reach a non-loopback address can use the model and empty its caches when no key
    is asked for: said at start, not discovered later."""
    exposed = [sock.getsockname()[0] for sock in sockets if not ipaddress.ip_address(sock.getsockname()[0]).is_loopback]
    if exposed and not (cfg.api_key or cfg.api_keys_file):
        log.warning("listening on %s without --api-key: anyone who can reach this address can generate, read "
                    "/metrics and empty the caches (set --api-key, or --host 127.0.0.1 for this machine only)",
                    ", ".join(exposed))


def run(cfg: ServeConfig) -> None:
    # What is cheap to check is checked before the port is taken; the port is taken before the
    # engine loads, so a port in use is refused in a moment, not after loading a model.
    for sig in (signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):  # handled once serving; harmless until then
        signal.signal(sig, signal.SIG_IGN)
    tokenizer = load_front_tokenizer(cfg)
    check_parallel_flags(cfg, launched_rank())
    cfg.check_http_settings()
    sockets = bind_sockets(cfg.host, cfg.port)
    if cfg.port == 0:  # the port the system picked is the daemon's (hand-overs name it to decode replicas)
        cfg = dataclasses.replace(cfg, port=sockets[0].getsockname()[1])
    shared = SharedFolder.make() if cfg.api_server_count > 1 else None
    others: ApiServers | None = None
    try:
        app, engine = build(cfg, tokenizer, shared)
        try:
            port = sockets[0].getsockname()[1]
            config = uvicorn_config(cfg, app, port)
            listen(sockets, cfg.host, config.backlog)
            if shared is not None:
                assert isinstance(engine, EngineCoreClient)
                others = ApiServers(cfg, sockets, engine, shared, app.state.front.config.created, run_api_server)
                app.state.before_engine_stops.append(others.stop)  # their streams end before the engine does
            log.info("serving %s at %s/v1 (OpenAI-compatible; /health, /metrics)%s", cfg.model_name,
                     served_url(sockets[0]), f" from {cfg.api_server_count} API-server processes" if others else "")
            warn_if_open(cfg, sockets)
            freeze_startup_objects()
            server = GracefulServer(config, engine, cfg.shutdown_timeout, cfg.watchdog_timeout,
                                    abandon_engine=engine.abandon if isinstance(engine, EngineCoreClient) else None,
                                    others=others)
            if others is not None:
                others.on_failure(server.api_server_failed)
            server.run(sockets=sockets)
        finally:
            if others is not None:
                others.stop()  # idempotent: normally done before the engine stopped
            engine.shutdown()  # idempotent: normally the app's lifespan has done it
    finally:
        for sock in sockets:
            sock.close()
        if shared is not None:
            shared.remove()
    if server.engine_failure is not None:
        raise EngineFailed(server.engine_failure)


def run_api_server(spec: ApiServerSpec, sockets: list[socket.socket]) -> None:
    """One of the other API servers (the spawn target): its own front end, on the first one's
    listening sockets, over the engine the first one started."""
    cfg = spec.cfg
    logging.basicConfig(level=cfg.log_level.upper(), format=LOG_FORMAT)
    name_process(API_SERVER_NAME)
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2):  # until serving: see GracefulServer
        signal.signal(sig, signal.SIG_IGN)
    use_multiprocess_values(spec.shared.metrics)
    tokenizer = load_front_tokenizer(cfg)
    vocabulary = tokenizer.vocabulary_json()
    engine = EngineCoreClient.attach(spec.addresses, spec.engine_pid, vocabulary, tokenizer.eos_token_id,
                                     cfg.grammar_cache_bytes)
    engine.wait_ready()
    prep = Preprocessor(tokenizer, PreprocessConfig(cfg.preprocess_workers, cfg.max_preprocess_seconds, cfg.model))
    prep.start()
    app = front_app(cfg, tokenizer, engine, engine.info, prep, spec.shared, spec.index, spec.created)
    server = GracefulServer(uvicorn_config(cfg, app, sockets[0].getsockname()[1]), engine, cfg.shutdown_timeout,
                            follower=True)
    freeze_startup_objects()
    try:
        server.run(sockets=sockets)
    finally:
        engine.shutdown()
    if server.engine_failure is not None:
        sys.exit(1)
