"""Independent pieces of CPU work spread over the intra-op threads, each piece's ops on one thread.

Torch ops on a CPU split each op over every intra-op thread and join them again: a barrier per op,
and a whole op's wait whenever the machine lends one of its cores elsewhere. Where a step has many
independent pieces of several milliseconds each (the indexer's tiles of a long prefill chunk), giving
each thread whole pieces instead, its ops single-threaded, spends nothing in barriers; with short
pieces it measured slower, so the caller decides when to use it.
Each piece computes exactly what it would alone: the indexer's tiles give bitwise the logits of
running them one after the other on every thread (tests/test_cpu_threads.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

_pool: tuple[ThreadPoolExecutor, int] | None = None  # the helper threads and how many
_pool_lock = threading.Lock()


def _helpers(count: int) -> ThreadPoolExecutor:
    """At least `count` helper threads (made once, more when more are asked for), each keeping its ops
    single-threaded."""
    global _pool
    with _pool_lock:
        if _pool is None or _pool[1] < count:
            if _pool is not None:
                _pool[0].shutdown(wait=False)
            _pool = (ThreadPoolExecutor(count, thread_name_prefix="v4serve-cpu", initializer=torch.set_num_threads,
                                        initargs=(1,)), count)
        return _pool[0]


def run_pieces(pieces: Sequence[Callable[[], None]]) -> None:
    """Run every piece once: spread round-robin over the intra-op threads when there are several (the
    caller's thread takes a share), else one after the other. Pieces must not depend on each other or
    on the order they run in, and must not talk to other processes (a collective's order would differ
    between ranks). The first piece to fail raises here, once all have stopped."""
    before = torch.get_num_threads()
    threads = min(before, len(pieces))
    if threads < 2:
        for piece in pieces:
            piece()
        return
    inference, grad = torch.is_inference_mode_enabled(), torch.is_grad_enabled()

    def share(k: int) -> None:
        with torch.inference_mode(inference), torch.set_grad_enabled(grad):  # thread-local: the caller's
            for piece in pieces[k::threads]:
                piece()

    pool = _helpers(threads - 1)
    torch.set_num_threads(1)
    try:
        helpers: list[Future[None]] = [pool.submit(share, k) for k in range(1, threads)]
        try:
            share(0)
        finally:
            for helper in helpers:  # all stopped before anything is raised or the threads restored
                helper.exception()
        for helper in helpers:
            helper.result()
    finally:
        torch.set_num_threads(before)
