"""Faults injected into a real engine, in whichever process runs it: `ServeConfig(engine_hook=
"tests.faults:NAME")` calls NAME(engine) once the engine is built (functions, not closures, because
the hook crosses into the engine process by name)."""

from __future__ import annotations

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


def fail_fourth_forward(engine: LLMEngine) -> None:
    _fail_forwards(engine, lambda n: n == 4)


def fail_forwards_after_third(engine: LLMEngine) -> None:
    _fail_forwards(engine, lambda n: n > 3)


def fail_sampling_with_seed_4242(engine: LLMEngine) -> None:
    sampler = engine.sampler
    real = sampler.sample

    def sample(request, logits):  # noqa: ANN001, ANN202 - the sampler's own signature
        if request.sampling.seed == 4242:
            raise RuntimeError("injected sampling fault")
        return real(request, logits)

    sampler.sample = sample


def exit_while_loading(spec: object, addresses: object, parent_pid: int) -> None:
    """An engine-process target that dies before reporting anything (as a crash in a native
    library or the OOM killer would)."""
    import os

    os._exit(3)
