"""The SSD prefix store on a long-document workload (tiny model): a document, then questions.

Per SWA caching mode and document length: time to first token cold, on a device-cache hit and
on a disk hit after a restart (page cache dropped for the store's files, so the disk is read);
bytes written per 1K prompt tokens; tokens recomputed per hit; and the floor of a disk hit —
bytes read ÷ this machine's measured disk read bandwidth + the uncached tail's compute (the
device-hit TTFT). Targets: at 64K tokens a disk hit is ≥ 20× faster than cold and within 3× of
the floor.

    python bench/bench_store.py [--docs 16384,65536] [--modes full,periodic,zero]
"""

from __future__ import annotations

import argparse
import mmap
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import print_table, time_to_first_token, write_results  # noqa: E402
from v4serve.engine.engine import EngineConfig, LLMEngine  # noqa: E402
from v4serve.engine.model.tiny import build_tiny  # noqa: E402
from v4serve.engine.request import Request, SamplingParams  # noqa: E402


def drop_page_cache(folder: Path) -> None:
    """Make the next reads of these files come from the disk, not from memory."""
    os.sync()
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def disk_read_bandwidth(folder: Path, size: int = 256 << 20) -> tuple[float, float]:
    """Bytes/s of a sequential read of a fresh file on the store's filesystem: with O_DIRECT
    (the device itself) and buffered after dropping it from the page cache (what reads see)."""
    path = folder / "bandwidth.probe"
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as f:
        for _ in range(size >> 20):
            f.write(chunk)
    drop_page_cache(folder)
    buf = mmap.mmap(-1, 4 << 20)  # page-aligned, as O_DIRECT needs
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    t0 = time.perf_counter()
    try:
        while os.readv(fd, [buf]):
            pass
    finally:
        os.close(fd)
    direct = size / (time.perf_counter() - t0)
    drop_page_cache(folder)
    t0 = time.perf_counter()
    with open(path, "rb", buffering=0) as f:
        while f.read(4 << 20):
            pass
    buffered = size / (time.perf_counter() - t0)
    path.unlink()
    return direct, buffered


def ttft(engine: LLMEngine, prompt: list[int]) -> tuple[float, Request]:
    req = Request(f"r{time.monotonic_ns()}", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    return time_to_first_token(engine, req), req


def one_case(model, mode: str, doc_len: int, folder: Path, bandwidth: float) -> dict:
    gen = torch.Generator().manual_seed(doc_len)
    doc = torch.randint(64, 320, (doc_len,), generator=gen).tolist()
    questions = [torch.randint(64, 320, (32,), generator=gen).tolist() for _ in range(3)]
    config = EngineConfig(max_model_len=doc_len + 256, max_num_seqs=2, swa_cache_mode=mode,
                          swa_checkpoint_interval=4096, kv_store_dir=str(folder),
                          max_num_batched_tokens=4096, max_prefill_chunk=4096)
    first = LLMEngine(model, config)
    cold, _ = ttft(first, doc + questions[0])
    device, device_req = ttft(first, doc + questions[1])
    first.close()
    written = first.kv.store.stats.bytes_written
    drop_page_cache(folder)
    second = LLMEngine(model, config)
    disk, disk_req = ttft(second, doc + questions[2])
    read = second.kv.store.stats.bytes_read
    second.close()
    floor = read / bandwidth + device
    return {"mode": mode, "doc_tokens": doc_len, "ttft_cold_s": cold, "ttft_device_hit_s": device,
            "ttft_disk_hit_s": disk, "cold_over_disk": cold / disk, "bytes_written_per_1k_tokens":
            written / (len(doc) + 32) * 1000, "bytes_read": read, "recomputed_tokens": disk_req.num_recomputed_tokens,
            "disk_hit_tokens": disk_req.num_disk_hit_tokens, "floor_s": floor, "disk_over_floor": disk / floor,
            "device_recomputed_tokens": device_req.num_recomputed_tokens}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--docs", default="16384,65536")
    parser.add_argument("--modes", default="full,periodic,zero")
    parser.add_argument("--dir", default=None, help="where to put the store (default: a temp folder)")
    args = parser.parse_args()
    model = build_tiny()
    base = Path(args.dir or tempfile.mkdtemp(prefix="bench-store-"))
    base.mkdir(parents=True, exist_ok=True)
    bandwidth, buffered = disk_read_bandwidth(base)
    print(f"disk read bandwidth: {bandwidth / 1e6:.0f} MB/s with O_DIRECT (used for the floor), "
          f"{buffered / 1e6:.0f} MB/s buffered after dropping the page cache")
    results = []
    for doc_len in [int(x) for x in args.docs.split(",")]:
        for mode in args.modes.split(","):
            results.append(one_case(model, mode, doc_len, base / f"{mode}-{doc_len}", bandwidth))
            r = results[-1]
            print(f"  {mode:>8} {doc_len:>6}: cold {r['ttft_cold_s']:.2f}s, device {r['ttft_device_hit_s']:.3f}s, "
                  f"disk {r['ttft_disk_hit_s']:.3f}s", flush=True)
    rows = [[r["doc_tokens"], r["mode"], r["ttft_cold_s"], r["ttft_device_hit_s"], r["ttft_disk_hit_s"],
             r["cold_over_disk"], r["floor_s"], r["disk_over_floor"], r["bytes_written_per_1k_tokens"],
             r["recomputed_tokens"]] for r in results]
    print_table("long document, new question: time to first token (s); cold/disk and disk/floor are ratios",
                ["doc", "mode", "cold", "device hit", "disk hit", "cold/disk", "floor", "disk/floor",
                 "written B/1K tok", "recomputed"], rows)
    write_results("bench_store", {"disk_read_bandwidth_bytes_s": bandwidth,
                                  "buffered_read_bandwidth_bytes_s": buffered, "cases": results})


if __name__ == "__main__":
    main()
