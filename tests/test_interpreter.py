"""Triton's interpreter with nested helper calls made cheap (kernels/interpreter.py): a launch patches
the language once, its helpers run without re-patching, and what they compute is unchanged."""

from __future__ import annotations

import pytest
import torch

import v4serve.kernels  # noqa: F401  (sets TRITON_INTERPRET=1 on a machine without CUDA, before triton loads)
from tests.helpers import requires_triton
from v4serve.kernels import interpreter

pytestmark = [requires_triton, pytest.mark.skipif(torch.cuda.is_available(),
                                                   reason="a CUDA machine compiles the kernels: no interpreter")]

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")
from triton.runtime import interpreter as triton_interpreter  # noqa: E402


@triton.jit
def _affine(x, k):
    return x * k + 1.0


@triton.jit
def _twice_affine_kernel(x_ptr, out_ptr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs)
    for k in tl.static_range(3):
        x = _affine(x, k + 1.0)
    tl.store(out_ptr + offs, x)


def test_a_launch_patches_the_language_once_and_its_helpers_compute_the_same(monkeypatch) -> None:
    assert interpreter.install(), "the pinned Triton's interpreter is the one kernels/interpreter.py was read against"
    patched_for: list[str] = []
    patch_lang = triton_interpreter._patch_lang

    def counting(fn):
        patched_for.append(fn.__name__)
        return patch_lang(fn)

    monkeypatch.setattr(triton_interpreter, "_patch_lang", counting)
    x = torch.arange(8, dtype=torch.float32)
    out = torch.empty_like(x)
    _twice_affine_kernel[(2,)](x, out, BLOCK=4)
    assert torch.equal(out, ((x * 1 + 1) * 2 + 1) * 3 + 1)
    assert patched_for == ["_twice_affine_kernel"]  # 2 programs × 3 helper calls, none re-patching


def test_a_helper_called_outside_a_launch_still_patches(monkeypatch) -> None:
    """The shortcut is only taken inside a launch: a helper called on its own (as Triton's own tests do)
    patches the language as before."""
    assert interpreter.install()
    patched_for: list[str] = []
    patch_lang = triton_interpreter._patch_lang
    monkeypatch.setattr(triton_interpreter, "_patch_lang", lambda fn: patched_for.append(fn.__name__) or patch_lang(fn))
    assert _affine(1.0, 2.0) == 3.0
    assert patched_for == ["_affine"]
