"""Triton's interpreter (how the Triton kernels run on a CPU), made cheaper to call helpers in.

Every call of a `@triton.jit` helper from inside a kernel (`_load_keys`, `tl.sum`, ...) makes the
interpreter re-patch `triton.language` for that helper (`_patch_lang`: a walk over the language's
members, ~2.4 ms), although the launch that called it patched the same modules already and keeps
them patched until it returns. That walk is a third of an interpreted forward pass. Within a launch,
a helper whose language modules are patched already is called directly; what it computes is the
same. Applied only for the Triton version whose interpreter this was read against; any other
version runs as it comes."""

from __future__ import annotations

import functools
import inspect
import threading
from types import ModuleType
from typing import Any

_TRITON_VERSION = "3.9."
_local = threading.local()


@functools.cache
def _language_modules(fn: Any) -> frozenset[ModuleType]:
    """The modules `_patch_lang` patches for `fn`: the `triton.language` modules in its globals."""
    import triton.language as tl

    return frozenset(v for v in fn.__globals__.values() if inspect.ismodule(v) and v in (tl, tl.core))


def install() -> bool:
    """Skip the re-patching of nested helper calls; returns whether it is in place."""
    import triton
    from triton.runtime import interpreter

    if getattr(interpreter, "_v4serve_nested_calls", False):
        return True
    if not triton.__version__.startswith(_TRITON_VERSION) or not all(
        hasattr(interpreter, name) for name in ("GridExecutor", "InterpretedFunction", "InterpreterError")
    ):
        return False
    launch_call = interpreter.GridExecutor.__call__
    helper_call = interpreter.InterpretedFunction.__call__

    def patched_launch(self: Any, *args: Any, **kwargs: Any) -> Any:
        outer = getattr(_local, "patched", None)
        _local.patched = set(_language_modules(self.fn))
        try:
            return launch_call(self, *args, **kwargs)
        finally:
            _local.patched = outer

    def patched_helper(self: Any, *args: Any, **kwargs: Any) -> Any:
        patched = getattr(_local, "patched", None)
        langs = _language_modules(self.fn)
        if patched is None or not langs <= patched:
            if patched is not None:
                patched.update(langs)
            return helper_call(self, *args, **kwargs)
        try:
            return self.rewrite()(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    interpreter.GridExecutor.__call__ = patched_launch
    interpreter.InterpretedFunction.__call__ = patched_helper
    interpreter._v4serve_nested_calls = True
    return True
