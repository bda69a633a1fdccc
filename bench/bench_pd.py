"""Prefill and decode apart: what long prompts do to the tokens of requests already decoding, with
prefill and decode on separate replicas (1P + 1D behind vllm-router's PD mode) against two mixed
replicas behind the same router (round robin), and what a hand-over costs against the prefill it saves.

Each replica is pinned to a core of its own (both set-ups get the same two cores): the tiny model on
loopback, each daemon with its own store. In each set-up, `--decoders` streams decode short prompts
while `--long` prompts of `--long-tokens` tokens arrive one after another (a "quiet" run has the
streams alone). A stream's inter-token latency (ITL) is the gap between its token events; TTFT is each
long prompt's time to first token through the router.

Then the hand-over itself, on the PD pair: a long prompt's prefill leg (max_tokens 1) on the prefill
replica, then its decode leg sent straight to the decode replica; the decode leg's time to first
token (fetch, store read, the last prompt token) over the prefill leg's time.

    .venv/bin/python bench/bench_pd.py [--decoders 8] [--long 2] [--long-tokens 16384]
                                       [--decode-tokens 300] [--quick]

prints the set-ups side by side and writes bench/results/bench_pd.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, write_results  # noqa: E402
from tests.daemon import PATIENCE, Daemon, start_daemon  # noqa: E402
from tests.routers import VLLM_ROUTER, router  # noqa: E402

MODEL = "v4serve-tiny"
WORDS = "alpha beta gamma delta epsilon kappa lambda sigma theta omega river stone cloud ember field".split()


def text(tokens: int, seed: int) -> str:
    """About `tokens` tokens of text (the tiny model's tokenizer is byte-level: one token per byte)."""
    out, i = f"[{seed}] ", seed
    while len(out) < tokens:
        out += WORDS[i % len(WORDS)] + " "
        i = i * 7 + 3
    return out[:tokens]


@contextlib.contextmanager
def pinned(core: int) -> Iterator[None]:
    """Processes started inside run on `core` alone (children inherit the affinity)."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {core})
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


# The fleet's peer secret (hand-overs are proven with it), given to each replica as operators do.
SECRET = {"V4SERVE_KV_PEER_SECRET": "bench-pd-peer-secret-0123456789abcdef"}


def replica(core: int, store: Path, *args: str) -> Daemon:
    with pinned(core):
        return start_daemon("--kv-store-dir", str(store), "--max-model-len", "40000", *args,
                            timeout=10 * PATIENCE, env=SECRET)


def stream_gaps(url: str, prompt: str, max_tokens: int, start: threading.Event) -> list[float]:
    """A streamed completion's gaps between token events (seconds)."""
    start.wait()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    stamps = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=10 * PATIENCE) as reply:
        for line in reply.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                stamps.append(time.perf_counter())
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # from the second token on


def long_prompts(url: str, count: int, tokens: int, start: threading.Event, delay: float) -> list[float]:
    """Long prompts one after another (the first once the streams are under way): each one's TTFT."""
    start.wait()
    time.sleep(delay)
    ttfts = []
    for i in range(count):
        body = {"model": MODEL, "prompt": text(tokens, 1000 + i + int(time.time())), "max_tokens": 4,
                "temperature": 0}
        t0 = time.perf_counter()
        httpx.post(url + "/v1/completions", json=body, timeout=20 * PATIENCE).raise_for_status()
        ttfts.append(time.perf_counter() - t0)  # 4 tokens: the first dominates
    return ttfts


def run(url: str, args: argparse.Namespace, long: int) -> dict[str, Any]:
    start = threading.Event()
    gaps: list[list[float]] = [[] for _ in range(args.decoders)]
    ttfts: list[float] = []

    def decoder(i: int) -> None:
        gaps[i] = stream_gaps(url, text(200, i), args.decode_tokens, start)

    def longs() -> None:
        ttfts.extend(long_prompts(url, long, args.long_tokens, start, delay=1.0))

    threads = [threading.Thread(target=decoder, args=(i,)) for i in range(args.decoders)]
    if long:
        threads.append(threading.Thread(target=longs))
    for t in threads:
        t.start()
    start.set()
    for t in threads:
        t.join()
    flat = sorted(g for gs in gaps for g in gs)
    return {"itl_p50_ms": 1000 * statistics.median(flat), "itl_p99_ms": 1000 * flat[int(0.99 * (len(flat) - 1))],
            "itl_max_ms": 1000 * flat[-1], "ttft_s": ttfts, "gaps": len(flat)}


def hand_over_cost(prefill: str, decode: str, tokens: int, repeats: int) -> dict[str, float]:
    """A long prompt's prefill leg on the prefill replica, then its decode leg straight to the decode
    replica: seconds of each (medians), and the hand-over's bytes."""
    legs: dict[str, list[float]] = {"prefill": [], "hand_over": []}
    for i in range(repeats):
        body = {"model": MODEL, "prompt": text(tokens, 5000 + i + int(time.time())), "max_tokens": 1,
                "temperature": 0}
        t0 = time.perf_counter()
        pre = httpx.post(prefill + "/v1/completions", json={**body, "min_tokens": 1, "kv_transfer_params": {
            "do_remote_decode": True}}, timeout=20 * PATIENCE).json()
        t1 = time.perf_counter()
        httpx.post(decode + "/v1/completions", json={**body, "kv_transfer_params": pre["kv_transfer_params"]},
                   timeout=20 * PATIENCE).raise_for_status()
        legs["prefill"].append(t1 - t0)
        legs["hand_over"].append(time.perf_counter() - t1)
    received = httpx.get(decode + "/metrics", timeout=PATIENCE).text
    nbytes = next(float(line.split()[-1]) for line in received.splitlines()
                  if line.startswith("v4serve_kv_transfer_received_bytes_total"))
    return {"prefill_s": statistics.median(legs["prefill"]), "hand_over_s": statistics.median(legs["hand_over"]),
            "bytes_per_hand_over": nbytes / repeats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoders", type=int, default=8)
    parser.add_argument("--long", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=16384)
    parser.add_argument("--decode-tokens", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=2, help="hand-overs timed")
    parser.add_argument("--quick", action="store_true", help="4K-token prompts, fewer tokens (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.long_tokens, args.decode_tokens, args.repeats = 4096, 120, 1
    cores = sorted(os.sched_getaffinity(0))
    second = cores[1 % len(cores)]
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        mixed = [replica(cores[0], root / "m0"), replica(second, root / "m1")]
        try:
            with router(VLLM_ROUTER, [d.url for d in mixed], policy="round_robin") as url:
                results["mixed, quiet"] = run(url, args, long=0)
                results["mixed, long prompts"] = run(url, args, long=args.long)
        finally:
            for d in mixed:
                d.stop()
        p = replica(cores[0], root / "p", "--kv-transfer-config", '{"kv_role": "kv_producer"}')
        consumer = json.dumps({"kv_role": "kv_consumer", "kv_connector_extra_config": {
            "producers": [p.url.removeprefix("http://")]}})
        d = replica(second, root / "d", "--kv-transfer-config", consumer)
        try:
            with router(VLLM_ROUTER, [], policy="round_robin",
                        extra=["--vllm-pd-disaggregation", "--prefill", p.url, "--decode", d.url]) as url:
                results["PD 1P+1D, quiet"] = run(url, args, long=0)
                results["PD 1P+1D, long prompts"] = run(url, args, long=args.long)
            cost = hand_over_cost(p.url, d.url, args.long_tokens, args.repeats)
        finally:
            p.stop()
            d.stop()
    rows = []
    for name, r in results.items():
        quiet = results[name.split(",")[0] + ", quiet"]
        rows.append([name, r["itl_p50_ms"], r["itl_p99_ms"], r["itl_p99_ms"] / quiet["itl_p99_ms"],
                     r["itl_p99_ms"] / quiet["itl_p50_ms"], statistics.median(r["ttft_s"]) if r["ttft_s"] else "-"])
    print_table(f"{args.decoders} streams decoding while {args.long} prompts of {args.long_tokens} tokens arrive "
                "(each replica on one core)",
                ["set-up", "ITL p50 ms", "ITL p99 ms", "p99 / quiet p99", "p99 / quiet p50", "long TTFT s"], rows)
    ratio = cost["hand_over_s"] / cost["prefill_s"]
    print_table(f"hand-over of a {args.long_tokens}-token prompt (PD pair)",
                ["prefill leg s", "decode leg s (fetch + read + last token)", "hand-over / prefill",
                 "MB handed over"],
                [[cost["prefill_s"], cost["hand_over_s"], ratio, cost["bytes_per_hand_over"] / 1e6]])
    write_results("bench_pd", {"args": vars(args), "setups": results, "hand_over": {**cost, "ratio": ratio}})


if __name__ == "__main__":
    main()
