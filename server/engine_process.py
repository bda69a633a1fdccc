"""What the engine-core process runs: the spawn target. Light on purpose (the front end imports it
to name the target); the model and torch are imported in the child only."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from v4serve.engine.process.ipc import CoreAddresses
from v4serve.server.config import LOG_FORMAT, ServeConfig


@dataclass(frozen=True)
class EngineSpec:
    """Everything the engine process needs, pickled across the spawn: the settings, and the
    vocabulary as data (for structured outputs; the engine never tokenizes)."""

    serve: ServeConfig
    tokenizer_json: str | None
    eos_token_id: int
    barred_token_ids: tuple[int, ...] = ()  # never sampled (the tokenizer's input-only specials)


def main(spec: EngineSpec, addresses: CoreAddresses, parent_pid: int) -> None:
    logging.basicConfig(level=spec.serve.log_level.upper(), format=LOG_FORMAT)
    from v4serve.engine.process.core import run_engine_core
    from v4serve.engine.process.lifecycle import leave
    from v4serve.server.model_loading import build_engine

    leave(run_engine_core(lambda: build_engine(spec.serve, spec.tokenizer_json, spec.eos_token_id,
                                                     spec.barred_token_ids),
                          addresses, parent_pid))
