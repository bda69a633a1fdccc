"""How v4serve's processes are named, stop and are described when they exit: the engine-core
process and the worker ranks are subordinates (the process in charge decides when they stop), and
a child's exit status is reported in words."""

from __future__ import annotations

import ctypes
import gc
import logging
import multiprocessing
import os
import signal
import sys

# Signals whose default ends a process and that reach a whole process group (a terminal's Ctrl-C and
# hangup, a service manager's stop, an operator's SIGUSR1/2 to the group).
GROUP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def setup_subordinate(name: str) -> None:
    """Name this process and ignore GROUP_SIGNALS: they reach every process of the group at once, and
    the one in charge (the front end for the engine process, rank 0 for the other ranks) decides what
    they mean and when and in what order the others stop."""
    for sig in GROUP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    name_process(name)


def name_process(name: str) -> None:
    """Set the kernel's name of this process (Linux; elsewhere nothing happens)."""
    try:
        libc = ctypes.CDLL(None)
        libc.prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


def leave(code: int) -> None:
    """End a subordinate process whose work is done (what must outlive it has landed: queued store
    writes, its own children stopped, its last messages sent) without the interpreter's teardown of
    torch: ~0.6 s of CPU at every stop. Logs and output are flushed first. A child process still
    running gets the ordinary exit, which waits for it."""
    if multiprocessing.active_children():
        sys.exit(code)
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    os._exit(code)


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        name = signal.Signals(-code).name if -code in signal.valid_signals() else str(-code)
        hint = " (the out-of-memory killer sends it too)" if -code == signal.SIGKILL else ""
        return f"killed by {name}{hint}"
    return f"exit status {code}"


def freeze_startup_objects() -> None:
    """Put everything alive once a process has started (modules, the model, the tokenizer: ~200K
    objects) out of the cycle collector's reach. A full collection scans every tracked object: with
    them, a 100 ms pause every few hundred decode steps at batch 256 (bench/bench_host.py); what
    serving creates afterwards is still collected. vLLM and SGLang freeze after start-up too."""
    gc.collect()
    gc.freeze()
