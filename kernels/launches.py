"""Counting the device work of a forward pass: non-view ATen ops (each is at least one kernel
launch on a GPU) plus Triton launches, which the dispatcher never sees and so are counted at
the launcher. Used by `bench/bench_launches.py` and the launch-budget tests."""

from __future__ import annotations

import os
import threading
from collections import Counter
from typing import Any

from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

_local = threading.local()


def interpreting() -> bool:
    """Whether Triton kernels run under Triton's interpreter (a CPU). There every op costs about
    the same whatever its size, so kernels pick fewer, larger tiles than on a GPU."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def launch(kernel: Any, *args: Any, **kwargs: Any) -> None:
    """Run one Triton launch, `kernel[grid]`, with its arguments: count it as one work item and
    hide the launch's own tensor handling (the interpreter copies arguments with torch ops) from
    the op counter. The arguments are evaluated by the caller first, so copies made to prepare
    them (a `.contiguous()` of a strided input) are counted as the device work they are."""
    counter: LaunchCounter | None = getattr(_local, "counter", None)
    if counter is None:
        kernel(*args, **kwargs)
        return
    counter.ops["triton"] += 1
    with _disable_current_modes():
        kernel(*args, **kwargs)


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
