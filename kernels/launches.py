"""Every Triton launch goes through `launch`, which can count it or record it:

- counting the device work of a forward pass: non-view ATen ops (each is at least one kernel launch
  on a GPU) plus Triton launches, which the dispatcher never sees and so are counted at the
  launcher (`LaunchCounter`: `bench/bench_launches.py` and the launch-budget tests);
- recording which specializations a forward launches, without running them (`LaunchRecorder`),
  so that they can be compiled for GPU targets on a machine without one (`kernels/aot.py`)."""

from __future__ import annotations

import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_local = threading.local()


def interpreting() -> bool:
    """Whether Triton kernels run under Triton's interpreter (a CPU). There every op costs about
    the same whatever its size, so kernels pick fewer, larger tiles than on a GPU. A recording
    (`LaunchRecorder`) is of what a GPU would launch: its tiles."""
    return os.environ.get("TRITON_INTERPRET") == "1" and getattr(_local, "recorder", None) is None


def launch(kernel: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """Run one Triton launch, `kernel[grid](*args, **kwargs)`: count it as one work item and hide the
    launch's own tensor handling (the interpreter copies arguments with torch ops) from the op
    counter; under a `LaunchRecorder`, record it instead of running it. The arguments are evaluated
    by the caller first, so copies made to prepare them (a `.contiguous()` of a strided input) are
    counted as the device work they are."""
    recorder: LaunchRecorder | None = getattr(_local, "recorder", None)
    if recorder is not None:
        recorder.record(kernel, grid, args, kwargs)
        return
    counter: LaunchCounter | None = getattr(_local, "counter", None)
    if counter is None:
        kernel[grid](*args, **kwargs)
        return
    counter.ops["triton"] += 1
    with _disable_current_modes():
        kernel[grid](*args, **kwargs)


@dataclass(frozen=True)
class Launch:
    """One launch as Triton specializes it, without the data: where the kernel is defined, each
    argument's description (`describe`), and the keyword arguments (constexprs, num_warps, ...)."""

    module: str
    kernel: str
    args: tuple[Any, ...]
    kwargs: tuple[tuple[str, Any], ...]

    @property
    def name(self) -> str:
        return self.kernel.strip("_").removesuffix("_kernel")


@dataclass(frozen=True)
class TensorArg:
    """A tensor as Triton's specialization sees it: its dtype, and whether its address is 16-byte
    aligned (its storage offset: allocations themselves are aligned)."""

    dtype: str
    aligned: bool


def describe(arg: Any) -> Any:
    """What Triton's specialization sees of an argument (hashable): a tensor's `TensorArg`, a number
    itself (Triton specializes integers equal to 1 and multiples of 16), a tuple's items."""
    if isinstance(arg, torch.Tensor):
        return TensorArg(str(arg.dtype).removeprefix("torch."), arg.storage_offset() * arg.element_size() % 16 == 0)
    if isinstance(arg, (tuple, list)):
        return tuple(describe(a) for a in arg)
    if isinstance(arg, torch.dtype):
        return str(arg)
    return arg


class LaunchRecorder:
    """with LaunchRecorder() as r: ... → r.launches, each distinct specialization once, in the
    order first seen; nothing runs (so a forward on the `meta` device can be recorded at any size)."""

    def __init__(self) -> None:
        self.launches: dict[Launch, int] = {}  # → how many times it was launched

    def record(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        fn = getattr(kernel, "fn", kernel)
        key = Launch(fn.__module__, fn.__name__, tuple(describe(a) for a in args),
                     tuple(sorted((k, describe(v)) for k, v in kwargs.items())))
        self.launches[key] = self.launches.get(key, 0) + 1

    def __enter__(self) -> LaunchRecorder:
        _local.recorder = self
        return self

    def __exit__(self, *exc: object) -> None:
        _local.recorder = None


class LaunchCounter(TorchDispatchMode):
    """with LaunchCounter() as c: ... → c.ops counts work items by name, c.total() their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if not func.is_view:
            self.ops[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    def __enter__(self) -> LaunchCounter:
        _local.counter = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _local.counter = None
        super().__exit__(*exc)

    def total(self) -> int:
        return sum(self.ops.values())
