"""Faults injected into a real engine, in whichever process runs it: `ServeConfig(engine_hook=
"tests.faults:NAME")` calls NAME(engine) once the engine is built (functions, not closures, because
the hook crosses into the engine process by name)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable

from v4serve.engine.engine import LLMEngine


def _fail_forwards(engine: LLMEngine, fail_calls: Callable[[int], bool]) -> None:
    """Make the model's forward raise on the calls (1-based) that `fail_calls` says."""
    model = engine.model
    calls = {"n": 0}
    real_forward = model.forward

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the model's own signature
        calls["n"] += 1
        if fail_calls(calls["n"]):
            raise RuntimeError("injected device fault")
        return real_forward(*args, **kwargs)

    model.forward = forward


# Open: forwards run. Closed by a test, every forward waits (an engine in this process: engine_in_process).
FORWARD_GATE = threading.Event()
FORWARD_GATE.set()


def gated_forwards(engine: LLMEngine) -> None:
    """A stalled device, for as long as a test holds FORWARD_GATE closed (a long prefill, held exactly)."""
    model = engine.model
    real_forward = model.forward

    def forward(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202 - the model's own signature
        FORWARD_GATE.wait()
        return real_forward(*args, **kwargs)

    model.forward = forward


def fail_fourth_forward(engine: LLMEngine) -> None:
    _fail_forwards(engine, lambda n: n == 4)


def fail_forwards_after_third(engine: LLMEngine) -> None:
    _fail_forwards(engine, lambda n: n > 3)


def fail_sampling_with_seed_4242(engine: LLMEngine) -> None:
    """Each row's host-side part of the step's batched sampling fails for seed 4242."""
    sampler = engine.sampler
    real = sampler.prepare

    def prepare(request, drafted=()):  # noqa: ANN001, ANN202 - the sampler's own signature
        if request.sampling.seed == 4242:
            raise RuntimeError("injected sampling fault")
        return real(request, drafted)

    sampler.prepare = prepare


def exit_while_loading(spec: object, addresses: object, parent_pid: int) -> None:
    """An engine-process target that dies before reporting anything (as a crash in a native
    library or the OOM killer would)."""
    import os

    os._exit(3)


def shard_failing_on_rank_1(parallel: object, local_rank: int) -> object:
    """A rank's loader (engine.process.rank_group.LoadShard) whose rank 1 raises, as on a bad shard."""
    if parallel.rank == 1:  # type: ignore[attr-defined]
        raise ValueError("injected: rank 1 cannot read its shard")
    return _tiny_shard(parallel, local_rank)


def shard_dying_on_rank_1(parallel: object, local_rank: int) -> object:
    """Rank 1's process ends mid-load (the OOM killer, a segfault) without a word to the others."""
    if parallel.rank == 1:  # type: ignore[attr-defined]
        os._exit(3)
    return _tiny_shard(parallel, local_rank)


def _tiny_shard(parallel: object, local_rank: int) -> object:
    from v4serve.server.config import ServeConfig
    from v4serve.server.model_loading import load

    return load(ServeConfig(model=os.environ["V4SERVE_TEST_CHECKPOINT"]), parallel, local_rank)  # type: ignore[arg-type]
