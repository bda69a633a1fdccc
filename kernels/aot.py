"""Compile recorded Triton launches for GPU targets on a machine without a GPU.

Triton's interpreter runs a kernel's Python body with numpy; it checks neither the types the
compiler infers nor registers or shared memory, so a kernel that runs interpreted can still fail
to compile, spill, or ask for more shared memory than a GPU has. Here each launch a forward makes
(recorded by `launches.LaunchRecorder`, arguments reduced to what Triton specializes on) is
compiled by Triton's own compiler for sm_80, sm_90 and sm_100 — through a stand-in driver that
reports the target, since nothing is launched — and its PTX is assembled by the `ptxas` that ships
with Triton, whose report gives registers and spills.

Compiling needs Triton in compiler mode, which a process that already imported it interpreted
cannot switch to: `compile_launches` runs the compiles in a child process (`python -m
v4serve.kernels.aot`), launches in and results out as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

from v4serve.kernels.launches import Launch, TensorArg


@dataclass(frozen=True)
class Target:
    name: str  # sm_80, sm_90, sm_100
    capability: int
    gpu: str  # the data-centre GPU of that architecture
    shared_limit: int  # bytes of shared memory one block may use (opt-in maximum)


TARGETS = (
    Target("sm_80", 80, "A100", 166_912),
    Target("sm_90", 90, "H100/H200", 232_448),
    Target("sm_100", 100, "B200", 232_448),
)


@dataclass(frozen=True)
class Compiled:
    """One launch compiled for one target: its resources, or why it did not compile."""

    kernel: str
    target: str
    registers: int = 0
    spill_stores: int = 0  # bytes per thread
    spill_loads: int = 0
    shared: int = 0  # bytes of shared memory per block
    shared_limit: int = 0
    num_warps: int = 0
    num_stages: int = 0
    error: str | None = None

    @property
    def spills(self) -> bool:
        return self.spill_stores > 0 or self.spill_loads > 0

    def problems(self) -> list[str]:
        """What would fail or slow down on that GPU: a compile error, shared memory over its limit, a
        block whose registers do not fit in an SM, spilled registers."""
        if self.error is not None:
            return [f"{self.kernel} on {self.target}: does not compile: {self.error}"]
        found = []
        if self.shared > self.shared_limit:
            found.append(f"{self.kernel} on {self.target}: {self.shared} B of shared memory, over the "
                         f"{self.shared_limit} B a block may use")
        if registers_per_block(self.registers, self.num_warps) > REGISTERS_PER_SM:
            found.append(f"{self.kernel} on {self.target}: {self.registers} registers × {self.num_warps * 32} threads "
                         f"is over the {REGISTERS_PER_SM} registers of an SM: the block cannot launch")
        if self.spills:
            found.append(f"{self.kernel} on {self.target}: spills {self.spill_stores} B stored / "
                         f"{self.spill_loads} B loaded per thread at {self.registers} registers")
        return found


# 32-bit registers in one SM's register file (sm_80, sm_90 and sm_100 alike); a block's threads must fit
# in it, each warp's registers allocated in units of 256 (8 per thread).
REGISTERS_PER_SM = 65_536


def registers_per_block(registers: int, num_warps: int) -> int:
    """What a block of `num_warps` warps takes of the register file at `registers` per thread."""
    return -(-registers // 8) * 8 * num_warps * 32


# Spills accepted outside the decode path, each with its reason (a decode step's kernels may never spill).
ALLOWED_SPILLS: dict[str, str] = {}


def problems(results: Iterable[Compiled], decode_kernels: set[str]) -> list[str]:
    """Everything that fails the check: compile errors, shared memory over a target's limit, spills in
    a kernel a decode step runs, and spills elsewhere that `ALLOWED_SPILLS` does not explain."""
    found = []
    for r in results:
        for problem in r.problems():
            if "spills" in problem and r.kernel not in decode_kernels and r.kernel in ALLOWED_SPILLS:
                continue
            found.append(problem)
    return sorted(set(found))


def table(results: Iterable[Compiled]) -> list[dict[str, Any]]:
    """Per kernel and target, the worst of its specializations: registers, spills, shared memory
    (and how many specializations, how many failed to compile)."""
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for r in results:
        row = rows.setdefault((r.kernel, r.target), {"kernel": r.kernel, "target": r.target, "specializations": 0,
                                                     "errors": 0, "registers": 0, "spill_stores": 0,
                                                     "spill_loads": 0, "shared": 0, "shared_limit": r.shared_limit})
        row["specializations"] += 1
        row["errors"] += r.error is not None
        for key in ("registers", "spill_stores", "spill_loads", "shared"):
            row[key] = max(row[key], getattr(r, key))
    order = {t.name: i for i, t in enumerate(TARGETS)}
    return sorted(rows.values(), key=lambda row: (row["kernel"], order[row["target"]]))


# ---- launches as JSON ----------------------------------------------------------------------------


def _encode(value: Any) -> Any:
    if isinstance(value, TensorArg):
        return {"tensor": value.dtype, "aligned": value.aligned}
    if isinstance(value, tuple):
        return {"tuple": [_encode(v) for v in value]}
    return value


def _decode(value: Any) -> Any:
    if isinstance(value, dict) and "tensor" in value:
        return TensorArg(value["tensor"], value["aligned"])
    if isinstance(value, dict) and "tuple" in value:
        return tuple(_decode(v) for v in value["tuple"])
    return value


def launch_to_json(launch: Launch) -> dict[str, Any]:
    return {"module": launch.module, "kernel": launch.kernel, "args": [_encode(a) for a in launch.args],
            "kwargs": [[k, _encode(v)] for k, v in launch.kwargs]}


def launch_from_json(obj: dict[str, Any]) -> Launch:
    return Launch(obj["module"], obj["kernel"], tuple(_decode(a) for a in obj["args"]),
                  tuple((k, _decode(v)) for k, v in obj["kwargs"]))


# ---- the parent side -----------------------------------------------------------------------------


def representatives(launches: Iterable[Launch]) -> list[Launch]:
    """One launch of each kind that can compile differently: the same kernel, argument dtypes,
    keyword arguments and integers equal to 1 (Triton makes those constants, which changes the
    types it infers). Other integers only move alignment hints, so their variants are dropped."""
    def kind(launch: Launch) -> tuple[Any, ...]:
        return launch.kernel, tuple(_kind_of(a) for a in launch.args), launch.kwargs

    found: dict[tuple[Any, ...], Launch] = {}
    for launch in launches:
        found.setdefault(kind(launch), launch)
    return list(found.values())


def _kind_of(arg: Any) -> Any:
    if isinstance(arg, TensorArg):
        return arg.dtype
    if isinstance(arg, tuple):
        return tuple(_kind_of(a) for a in arg)
    if isinstance(arg, int) and not isinstance(arg, bool):
        return arg == 1
    return arg if not isinstance(arg, float) else "float"


def compile_launches(launches: Iterable[Launch], targets: Sequence[Target] = TARGETS, jobs: int = 1,
                     timeout: float | None = None) -> list[Compiled]:
    """Each launch compiled for each target (in `jobs` child processes: see the module's docstring),
    in the order launch by launch, target by target."""
    work = [(launch_to_json(x), t.name) for x in launches for t in targets]
    parts = [work[i::jobs] for i in range(max(1, jobs))]
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    children = [subprocess.Popen([sys.executable, "-m", "v4serve.kernels.aot"], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
                for _ in parts]
    with ThreadPoolExecutor(len(children)) as pool:  # every child gets its work at once
        answers = list(pool.map(lambda c, p: c.communicate(json.dumps(p), timeout=timeout), children, parts))
    results: list[list[Compiled]] = []
    for child, (out, err) in zip(children, answers, strict=True):
        if child.returncode != 0:
            raise RuntimeError(f"the compile process failed ({child.returncode}):\n{err[-4000:]}")
        results.append([Compiled(**row) for row in json.loads(out.splitlines()[-1])])
    merged: list[Compiled] = []
    for i in range(len(work)):  # undo the round-robin split
        merged.append(results[i % len(parts)][i // len(parts)])
    return merged


# ---- the child side: Triton in compiler mode -----------------------------------------------------


def _child(work: list[tuple[dict[str, Any], str]]) -> list[Compiled]:
    import triton  # compiler mode: TRITON_INTERPRET=0 was set before anything imported it

    targets = {t.name: t for t in TARGETS}
    out = []
    for obj, name in work:
        target = targets[name]
        triton.runtime.driver.set_active(_stand_in_driver(target.capability))
        out.append(_compile_one(launch_from_json(obj), target))
    return out


def _compile_one(launch: Launch, target: Target) -> Compiled:
    from triton.compiler.errors import CompilationError

    kernel = getattr(importlib.import_module(launch.module), launch.kernel)
    args = [_stand_in(a) for a in launch.args]
    kwargs = {k: _stand_in(v) for k, v in launch.kwargs}
    try:
        compiled = kernel.warmup(*args, grid=(1,), **kwargs)
    except CompilationError as exc:
        return Compiled(launch.name, target.name, shared_limit=target.shared_limit, error=_first_line(exc))
    registers, stores, loads = _ptxas_report(compiled.asm["ptx"], target.capability)
    meta = compiled.metadata
    return Compiled(launch.name, target.name, registers, stores, loads, meta.shared, target.shared_limit,
                    meta.num_warps, meta.num_stages)


def _first_line(exc: Exception) -> str:
    """The compiler's own message (Triton prefixes it with the failing source line)."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


def _stand_in_driver(capability: int) -> Any:
    """A Triton driver that reports a CUDA target and launches nothing: enough for `warmup`, which
    compiles. Its device id is the capability, so each target gets its own caches."""
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.backends.driver import DriverBase

    class StandIn(DriverBase):
        @classmethod
        def is_active(cls) -> bool:
            return False

        def get_current_target(self) -> GPUTarget:
            return GPUTarget("cuda", capability, 32)

        def get_active_torch_device(self) -> torch.device:
            return torch.device("cpu")

        def get_current_device(self) -> int:
            return capability

        def get_current_stream(self, device: int | None = None) -> int:
            return 0

        def get_benchmarker(self) -> Any:
            raise RuntimeError("nothing runs on a stand-in driver")

        def map_python_to_cpp_type(self, ty: str) -> str:
            raise RuntimeError("nothing runs on a stand-in driver")

    return StandIn()


def _stand_in(value: Any) -> Any:
    """What Triton's specialization reads of an argument: a tensor becomes a mock with its dtype and
    an address as aligned as the recorded one."""
    import torch
    from triton.runtime.jit import MockTensor

    if isinstance(value, TensorArg):
        mock = MockTensor(getattr(torch, value.dtype))
        if not value.aligned:
            mock.data_ptr = lambda: 4  # type: ignore[method-assign]
        return mock
    if isinstance(value, tuple):
        return tuple(_stand_in(v) for v in value)
    return value


_REPORT = re.compile(r"Used (\d+) registers")
_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def _ptxas_report(ptx: str, capability: int) -> tuple[int, int, int]:
    """(registers, spill store bytes, spill load bytes) from `ptxas -v` of Triton's own PTX, with the
    flags Triton's backend assembles it with."""
    from triton.backends.nvidia.compiler import get_ptxas, sm_arch_from_capability

    with tempfile.TemporaryDirectory(prefix="v4serve-aot-") as tmp:
        src = os.path.join(tmp, "kernel.ptx")
        with open(src, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(capability).path, "-v", "--regAllocOptLevel=2",
                               f"--gpu-name={sm_arch_from_capability(capability)}", src, "-o",
                               os.path.join(tmp, "kernel.cubin")], capture_output=True, text=True, check=True)
    report = done.stderr
    registers = max((int(m) for m in _REPORT.findall(report)), default=0)
    spills = [(int(a), int(b)) for a, b in _SPILLS.findall(report)]
    return registers, sum(a for a, _ in spills), sum(b for _, b in spills)


def main() -> None:
    results = _child(json.load(sys.stdin))
    print(json.dumps([asdict(r) for r in results]))


if __name__ == "__main__":
    main()
