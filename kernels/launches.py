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
from torch.utils import _pytree as pytree
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


def _traced(arg: Any) -> Any:
    """An argument as a step trace keeps it: a tensor's shape, strides and dtype (never its values),
    a number itself, a sequence's items."""
    if isinstance(arg, torch.Tensor):
        return tuple(arg.shape), arg.stride(), str(arg.dtype).removeprefix("torch.")
    if isinstance(arg, (tuple, list)):
        return tuple(_traced(a) for a in arg)
    if isinstance(arg, (bool, int, float, str, type(None))):
        return arg
    return type(arg).__name__


class StepTrace(LaunchRecorder):
    """with StepTrace() as t: ... → t.events, in order: every ATen op (its name, its arguments'
    shapes, strides, dtypes and numbers) and every Triton launch (kernel, grid, arguments,
    constexprs); nothing Triton runs. It is what a CUDA graph freezes of a step: two steps with
    equal traces can replay one capture (given their inputs in the same buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[Any, ...]] = []
        self._mode = _OpTrace(self.events)

    def record(self, kernel: Any, grid: tuple[int, ...], args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        super().record(kernel, grid, args, kwargs)
        name = getattr(kernel, "fn", kernel).__name__
        self.events.append(("launch", name, tuple(grid), _traced(args), tuple(sorted(kwargs.items()))))

    def __enter__(self) -> StepTrace:
        super().__enter__()
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._mode.__exit__(*exc)
        super().__exit__(*exc)


class _OpTrace(TorchDispatchMode):
    def __init__(self, events: list[tuple[Any, ...]]) -> None:
        super().__init__()
        self.events = events

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        self.events.append(("op", str(func), _traced(args), _traced(sorted(kwargs.items()))))
        return func(*args, **kwargs)


def is_work(func: Any, out: Any, args: Any) -> bool:
    """Whether an ATen op is device work: any op not marked a view, and a view-marked op whose result
    has storage of its own. Under inference mode `.float()`, `.to(dtype)`, `.contiguous()` and
    `reshape` reach a dispatch mode whole (`aten.to`, ...), marked as views since they may return
    their input; when they copy instead, that is a kernel on a GPU. (Storage identity, not data
    pointers: those are all 0 on the meta device.)"""
    if not func.is_view:
        return True
    if not (isinstance(out, torch.Tensor) and args and isinstance(args[0], torch.Tensor)):
        return False
    return out.untyped_storage()._cdata != args[0].untyped_storage()._cdata


class LaunchCounter(TorchDispatchMode):
    """with LaunchCounter() as c: ... → c.ops counts work items by name, c.total() their sum."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if is_work(func, out, args):
            self.ops[str(func.overloadpacket)] += 1
        return out

    def __enter__(self) -> LaunchCounter:
        _local.counter = self
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        _local.counter = None
        super().__exit__(*exc)

    def total(self) -> int:
        return sum(self.ops.values())


# Ops whose result depends on device values, read back by the host: each is a synchronisation.
_READS_BACK = ("_local_scalar_dense", "nonzero", "unique", "_unique", "_unique2", "unique_consecutive", "unique_dim",
               "bincount", "masked_select", "repeat_interleave", "item", "equal", "is_nonzero")


def _mixes_host_and_device(args: Any, kwargs: dict[str, Any]) -> bool:
    """An op given CPU tensors (not 0-dim: those pass as scalars) beside device tensors copies them
    to the device itself, from pageable memory, blocking: `x[list_of_ints]` on a GPU tensor does."""
    tensors = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    on_host = any(t.device.type == "cpu" and t.dim() > 0 for t in tensors)
    return on_host and any(t.device.type != "cpu" for t in tensors)


class HostSyncs(TorchDispatchMode):
    """with HostSyncs() as s: ... → s.found, every point where the host waits for the device: ops
    that read device values back (`.item()`, `nonzero`, `unique`, `bincount`, ...), copies between
    the host and the device that block, and Python-level reads (`.tolist()`, `.item()`, `.numpy()`,
    `bool()`/`int()` of a device tensor). Meant for a forward on the `meta` device (or a GPU): there
    every tensor the forward computes is a device tensor, so any of these is a sync."""

    _HOOKED = ("tolist", "item", "numpy", "__bool__", "__int__", "__float__", "__index__")
    _INDEXING = ("__getitem__", "__setitem__")

    def __init__(self) -> None:
        super().__init__()
        self.found: list[str] = []
        self.ops: Counter[str] = Counter()
        self.transfers = 0  # copies between host and device, blocking or not
        self._saved: dict[str, Any] = {}

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        self.ops[name] += 1
        if name in _READS_BACK:
            self.found.append(f"aten.{name} reads the device back")
        elif name in ("_to_copy", "to", "copy_"):
            self._check_copy(name, func, args, kwargs)
        elif _mixes_host_and_device(args, kwargs):
            self.found.append(f"aten.{name} takes host tensors beside device ones (a hidden blocking copy)")
        return func(*args, **kwargs)

    def _check_copy(self, name: str, func: Any, args: Any, kwargs: dict[str, Any]) -> None:
        bound = {**dict(zip((a.name for a in func._schema.arguments), args, strict=False)), **kwargs}
        if name == "copy_":
            src, dst = bound["src"].device, bound["self"].device
        else:
            other = bound.get("other")
            target = other.device if isinstance(other, torch.Tensor) else bound.get("device")
            src = bound["self"].device
            dst = torch.device(target) if target is not None else src
        crosses = (src.type == "cpu") != (dst.type == "cpu")
        self.transfers += crosses
        if crosses and dst.type == "cpu":
            self.found.append(f"aten.{name} copies device → host")
        elif crosses and not bound.get("non_blocking", False):
            self.found.append(f"aten.{name} copies host → device, blocking")

    def __enter__(self) -> HostSyncs:
        for attr in self._HOOKED:
            self._saved[attr] = getattr(torch.Tensor, attr)
            setattr(torch.Tensor, attr, self._hook(attr, self._saved[attr]))
        for attr in self._INDEXING:
            self._saved[attr] = getattr(torch.Tensor, attr)
            setattr(torch.Tensor, attr, self._index_hook(attr, self._saved[attr]))
        return super().__enter__()

    def __exit__(self, *exc: object) -> None:
        for attr, fn in self._saved.items():
            setattr(torch.Tensor, attr, fn)
        super().__exit__(*exc)

    def _hook(self, attr: str, fn: Any) -> Any:
        found = self.found

        def read(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if tensor.device.type != "cpu":
                found.append(f"Tensor.{attr}() of a {tensor.device.type} tensor")
            return fn(tensor, *args, **kwargs)

        return read

    def _index_hook(self, attr: str, fn: Any) -> Any:
        """Indexing a device tensor with a Python list (or a CPU tensor) builds the index on the host
        and copies it up, blocking, below the dispatcher (`h[rows]` with rows a list)."""
        found = self.found

        def index(tensor: torch.Tensor, key: Any, *args: Any) -> Any:
            keys = key if isinstance(key, tuple) else (key,)
            if tensor.device.type != "cpu" and any(
                    isinstance(k, list) or (isinstance(k, torch.Tensor) and k.device.type == "cpu" and k.dim() > 0)
                    for k in keys):
                found.append(f"Tensor.{attr} of a {tensor.device.type} tensor with host indices (a blocking copy)")
            return fn(tensor, key, *args)

        return index
