"""Shared helpers for benchmarks: interleaved timing and result files."""

from __future__ import annotations

import json
import platform
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def time_to_first_token(engine: Any, request: Any) -> float:
    """Seconds from adding a request to an engine until its first token; then run it out."""
    t0 = time.perf_counter()
    engine.add_request(request)
    while not request.output_token_ids:
        engine.step()
    elapsed = time.perf_counter() - t0
    while engine.has_work():
        engine.step()
    return elapsed


def decode_seconds(engine: Any, requests: list[Any]) -> float:
    """Add `requests` to an engine, run until each has its first token (prefill done), then time the
    steps until all have finished: the seconds of pure decoding."""
    for r in requests:
        engine.add_request(r)
    while not all(r.output_token_ids for r in requests):
        engine.step()
    t0 = time.perf_counter()
    while engine.has_work():
        engine.step()
    return time.perf_counter() - t0


def interleaved(fns: dict[str, Callable[[], Any]], repeats: int) -> dict[str, float]:
    """Median seconds of each function, run in turns (A B A B ...) so that noise from a shared
    machine lands on all of them alike."""
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(ts) for name, ts in times.items()}


def print_table(title: str, header: list[str], rows: list[list[Any]]) -> None:
    cells = [header] + [[f"{c:.3g}" if isinstance(c, float) else str(c) for c in row] for row in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    print(f"\n{title}")
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths, strict=True)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def write_results(name: str, payload: dict[str, Any]) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    payload = {"machine": {"platform": platform.platform(), "torch": torch.__version__,
                           "threads": torch.get_num_threads()}, **payload}
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"\nresults written to {path}")
    return path
