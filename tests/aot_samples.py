"""Triton kernels that a GPU compiler refuses or that would run badly on a GPU, yet run under the
interpreter: tests/test_aot.py shows the ahead-of-time check catches each. (Importable by the
compile process, which loads kernels by module name.)"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def loop_changes_a_shape(out_ptr, n, BLOCK: tl.constexpr):
    """A loop-carried variable whose shape changes inside the loop (index_topk had this bug)."""
    x = tl.zeros([1], tl.int32)
    for i in range(0, n, BLOCK):
        x = tl.arange(0, BLOCK)[None, :] + i
    tl.store(out_ptr + tl.arange(0, 1), tl.sum(x))


@triton.jit
def too_much_shared_memory(a_ptr, b_ptr, c_ptr, K, BLOCK: tl.constexpr):
    """Wide dot tiles pipelined deep: more shared memory than an A100 gives a block."""
    rows = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK, BLOCK], tl.float32)
    for k0 in range(0, K, BLOCK):
        a = tl.load(a_ptr + rows[:, None] * K + k0 + rows[None, :])
        b = tl.load(b_ptr + (k0 + rows[:, None]) * BLOCK + rows[None, :])
        acc += tl.dot(a, b)
    tl.store(c_ptr + rows[:, None] * BLOCK + rows[None, :], acc)


@triton.jit
def holds_too_much(x_ptr, out_ptr, BLOCK: tl.constexpr):
    """A [BLOCK, BLOCK] fp32 tile kept live across a reduction: far more than a thread's registers."""
    rows = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + rows[:, None] * BLOCK + rows[None, :])
    total = tl.sum(x, axis=0)
    tl.store(out_ptr + rows[:, None] * BLOCK + rows[None, :], x * total[None, :] + tl.sum(x * x, axis=1)[:, None])
