"""Tensor and expert parallelism through the daemon (two CPU ranks over gloo): the single process's
greedy tokens over HTTP, prefix hits in every SWA mode and SSD-store restarts equal to cold runs at
size 2 with every rank holding the same KV bytes, stores of one size never read at another, a dying
rank or engine process ending the daemon cleanly, and torchrun as the launcher of the ranks."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.daemon import PATIENCE, ROOT, in_process_server, served_at, start_daemon, wait_until
from tests.helpers import SMALL, tokens
from tests.test_engine_process import ENDLESS, engine_pid, gone, processes
from tests.test_store_daemon import metric
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.server.config import LaunchedRank, ServeConfig, check_parallel_flags, launched_rank
from v4serve.server.text.tokenizer import write_byte_tokenizer_files

# Window 8, ratios 4/16, blocks of 16 tokens: short prompts cross every edge. 8 heads, 4 output
# groups and 8 experts: several of each per rank, and an expert-parallel split of 4 + 4.
WIDE = {**SMALL, "num_heads": 8, "o_groups": 4, "n_routed_experts": 8}
# Around the block (16) and window (8) edges, and long enough for several compressed blocks.
LENGTHS = (1, 7, 8, 9, 15, 16, 17, 33, 100)
PROMPTS = [tokens(n, 40 + n) for n in LENGTHS]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> str:
    folder = write_checkpoint(build_tiny(tiny_config(**WIDE), seed=9), tmp_path_factory.mktemp("wide"))
    write_byte_tokenizer_files(folder)
    return str(folder)


def complete(url: str, prompt: list[int], n: int = MAX_TOKENS, **fields: Any) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 1, **fields}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE)
    assert resp.status_code == 200, resp.text
    return resp.json()


def greedy(url: str, prompts: list[list[int]]) -> list[dict]:
    """Every prompt at once (ragged batches of prefill chunks and decodes): tokens and logprobs."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(lambda p: complete(url, p), prompts))
    return [r["choices"][0]["logprobs"] for r in results]


def cached(result: dict) -> int:
    return result["usage"]["prompt_tokens_details"]["cached_tokens"]


def kv_digests(engine: object) -> list[str]:
    return asyncio.run(engine.command("kv_digests"))  # type: ignore[attr-defined]


def serve_config(model: str, **kw: object) -> ServeConfig:
    return ServeConfig(model=model, **{"no_kv_store": True, **kw})  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def wide_mtp(tmp_path_factory: pytest.TempPathFactory) -> str:
    """`wide` with a multi-token-prediction layer (the same main weights)."""
    model = build_tiny(tiny_config(**WIDE, num_nextn_predict_layers=1), seed=9)
    folder = write_checkpoint(model, tmp_path_factory.mktemp("wide-mtp"))
    write_byte_tokenizer_files(folder)
    return str(folder)


@pytest.fixture(scope="module")
def single(wide: str) -> list[dict]:
    """One process's outputs: the reference."""
    with in_process_server(serve_config(wide)) as (url, engine):
        out = greedy(url, PROMPTS)
        assert len(set(kv_digests(engine))) == 1
    return out


NGRAM = '{"method": "ngram", "num_speculative_tokens": 3}'
MTP = '{"method": "mtp", "num_speculative_tokens": 2}'


@pytest.mark.parametrize(("expert_parallel", "speculative"),
                         [(False, None), (True, None), (False, NGRAM), (True, MTP)],
                         ids=["tp2", "ep2", "tp2-drafts", "ep2-mtp"])
def test_two_ranks_serve_the_single_process_tokens(wide: str, wide_mtp: str, single: list[dict],
                                                   expert_parallel: bool, speculative: str | None) -> None:
    """With speculative drafts too: a rejected draft's slot is put back on every rank (the same KV bytes);
    the MTP layer drafts on both ranks alike (its window and state rows the same bytes too)."""
    model = wide_mtp if speculative == MTP else wide
    cfg = serve_config(model, tensor_parallel_size=2, expert_parallel=expert_parallel, speculative_config=speculative)
    with in_process_server(cfg) as (url, engine):
        version = httpx.get(url + "/version", timeout=PATIENCE).json()
        out = greedy(url, PROMPTS)
        digests = kv_digests(engine)
        drafts = metric(url, "v4serve_spec_decode_num_drafts_total")
    assert version["tensor_parallel_size"] == 2 and version["expert_parallel"] is expert_parallel
    assert version["attention_backend"] == "torch"
    for got, want in zip(out, single, strict=True):
        assert got["tokens"] == want["tokens"]
        # Logits within 1e-4 relative of one process (tests/test_parallel.py); log-probs follow.
        assert got["token_logprobs"] == pytest.approx(want["token_logprobs"], abs=1e-3)
    assert len(digests) == 2 and digests[0] == digests[1]  # same KV bytes on both ranks
    assert (drafts > 0) is (speculative is not None)


@pytest.fixture(scope="module")
def packed(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The released layout (FP4 routed experts, FP8 attention and shared expert), sized so each
    rank's shard falls on whole 128-row scale blocks (as tests/test_parallel.py's packed config)."""
    model = build_tiny(tiny_config(o_lora_rank=128, moe_intermediate_size=256), seed=5)
    folder = write_checkpoint(model, tmp_path_factory.mktemp("packed"), quantize="mixed")
    write_byte_tokenizer_files(folder)
    return str(folder)


def test_packed_weights_and_fp8_kv_at_two_ranks(packed: str) -> None:
    """What a real deployment runs: checkpoint-precision weights split over the ranks, FP8 KV
    records replicated on each, prefix hits included."""
    prompts = [tokens(n, 100 + n) for n in (1, 127, 128, 129, 300)]
    settings = {"kv_cache_dtype": "fp8", "swa_cache_mode": "full"}
    with in_process_server(serve_config(packed, **settings)) as (url, _):
        one = greedy(url, prompts)
    with in_process_server(serve_config(packed, tensor_parallel_size=2, expert_parallel=True, **settings)) as (
            url, engine):
        version = httpx.get(url + "/version", timeout=PATIENCE).json()
        two = greedy(url, prompts)
        hit = complete(url, prompts[-1])
        digests = kv_digests(engine)
    assert version["weight_dtype"] == "checkpoint" and version["kv_cache_dtype"] == "fp8_e4m3"
    assert [o["tokens"] for o in two] == [o["tokens"] for o in one]
    assert cached(hit) > 0 and hit["choices"][0]["logprobs"]["tokens"] == two[-1]["tokens"]
    assert digests[0] == digests[1]


def test_prefix_hits_at_two_ranks_equal_cold_runs(wide: str) -> None:
    """In each SWA mode (the request's own `swa_cache_mode`: one server for the three)."""
    doc = tokens(100, 50)
    # Shared prefixes ending just before, on and after a block edge (16 per block) and a window edge.
    asks = [doc[:n] + tokens(5, 60 + n) for n in (47, 48, 49, 63, 64, 65, 100)]
    cfg = serve_config(wide, tensor_parallel_size=2, swa_checkpoint_interval=32)
    with in_process_server(cfg) as (url, engine):
        cold = []
        for prompt in asks:
            httpx.post(url + "/reset_prefix_cache", timeout=PATIENCE).raise_for_status()
            cold.append(complete(url, prompt))
        for mode in ("full", "periodic", "zero"):
            httpx.post(url + "/reset_prefix_cache", timeout=PATIENCE).raise_for_status()
            hits_before = metric(url, "v4serve_prefix_cache_hits_total", source="device")
            complete(url, doc + tokens(3, 70), swa_cache_mode=mode)  # caches the document
            warm = [complete(url, prompt, swa_cache_mode=mode) for prompt in asks]
            again = complete(url, asks[-1], swa_cache_mode=mode)  # the whole prompt, then its own output
            hits = metric(url, "v4serve_prefix_cache_hits_total", source="device") - hits_before
            digests = kv_digests(engine)
            for c, w in zip(cold, warm, strict=True):
                assert w["choices"][0]["logprobs"]["tokens"] == c["choices"][0]["logprobs"]["tokens"], mode
            assert again["choices"][0]["logprobs"]["tokens"] == cold[-1]["choices"][0]["logprobs"]["tokens"], mode
            assert all(cached(w) > 0 for w in warm[1:]) and cached(again) > 0 and hits > 0, mode
            assert digests[0] == digests[1], mode  # restores reached rank 1 too


def test_a_store_is_never_read_across_sizes_and_restarts_at_two_ranks(wide: str, tmp_path: Path) -> None:
    """KV computed at one parallel size differs from another's in the last bits: each size has its
    own namespace in the store, so a store written at size 1 is a miss at size 2 (never read
    wrongly), and a size-2 store serves the next size-2 daemon from disk."""
    prompt = tokens(90, 80)
    store = {"no_kv_store": False, "kv_store_dir": str(tmp_path), "swa_cache_mode": "periodic",
             "swa_checkpoint_interval": 32}
    with in_process_server(serve_config(wide, **store)) as (url, _):
        one = complete(url, prompt)
    written_at_one = set(tmp_path.rglob("*.blk"))
    assert written_at_one
    with in_process_server(serve_config(wide, tensor_parallel_size=2, **store)) as (url, _):
        first = complete(url, prompt)
        disk_first = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
    assert disk_first == 0 and cached(first) == 0  # the size-1 files were not read
    assert first["choices"][0]["logprobs"]["tokens"] == one["choices"][0]["logprobs"]["tokens"]
    assert set(tmp_path.rglob("*.blk")) > written_at_one  # size 2 wrote its own
    with in_process_server(serve_config(wide, tensor_parallel_size=2, **store)) as (url, engine):
        restarted = complete(url, prompt)
        disk = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
        digests = kv_digests(engine)
    assert disk > 0 and cached(restarted) > 0
    assert restarted["choices"][0]["logprobs"]["tokens"] == first["choices"][0]["logprobs"]["tokens"]
    assert digests[0] == digests[1]  # the blocks read from disk reached rank 1


def process_children(parent: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{parent}/task/{parent}/children").read_text().split()]


def rank_pid(engine: int) -> int:
    for pid in process_children(engine):
        if Path(f"/proc/{pid}/comm").read_text().strip() == "v4serve-rank1":
            return pid
    raise AssertionError(f"no v4serve-rank1 under the engine process {engine}")


def stream_until_cut(url: str, lines: list[str]) -> None:
    with httpx.stream("POST", url + "/v1/completions", json=ENDLESS, timeout=PATIENCE) as resp:
        for line in resp.iter_lines():
            if line.startswith("data: "):
                lines.append(line)


def test_a_killed_rank_is_a_503_then_an_exit_with_no_orphans(wide: str) -> None:
    running = start_daemon("--model", wide, "--tensor-parallel-size", "2")
    try:
        engine = engine_pid(running.proc.pid)
        rank = rank_pid(engine)
        lines: list[str] = []
        reader = threading.Thread(target=stream_until_cut, args=(running.url, lines))
        reader.start()
        wait_until(lambda: len(lines) > 3, "the stream to run")
        os.kill(rank, signal.SIGKILL)
        reader.join(timeout=PATIENCE)
        assert not reader.is_alive() and lines[-1] == "data: [DONE]" and "error" in lines[-2]
        health = httpx.get(running.url + "/health", timeout=PATIENCE)  # before the exit, 2 s after the death
        assert health.status_code == 503 and "rank" in health.json()["error"]["message"]
        wait_until(lambda: running.proc.poll() is not None, "the daemon to exit")
        assert running.proc.returncode == 1
        wait_until(lambda: gone(engine) and gone(rank), "the engine process and the rank to exit")
    finally:
        running.stop(signal.SIGKILL)


def test_a_killed_engine_process_takes_its_ranks_with_it(wide: str) -> None:
    running = start_daemon("--model", wide, "--tensor-parallel-size", "2")
    try:
        engine = engine_pid(running.proc.pid)
        rank = rank_pid(engine)
        os.kill(engine, signal.SIGKILL)
        wait_until(lambda: running.proc.poll() is not None, "the daemon to exit")
        assert running.proc.returncode == 1
        wait_until(lambda: gone(rank), "the rank to exit")
    finally:
        running.stop(signal.SIGKILL)


def test_one_failed_step_ends_a_parallel_engine(wide: str) -> None:
    """One process fails only the requests of a failed step and goes on; ranks that may be waiting in
    different collectives cannot, so the engine stops at once with the cause (then 503s)."""
    cfg = serve_config(wide, tensor_parallel_size=2, engine_hook="tests.faults:fail_fourth_forward")
    with in_process_server(cfg) as (url, engine):
        for _ in range(3):
            complete(url, tokens(5, 91), n=1)  # one forward each
        failed = httpx.post(url + "/v1/completions", json={"prompt": tokens(5, 92), "max_tokens": 2},
                            timeout=PATIENCE)
        wait_until(lambda: engine.unavailable_reason() is not None, "the engine to stop")
        health = httpx.get(url + "/health", timeout=PATIENCE)
    # The fault's kind reaches the client, never its text (that stays in the engine's log).
    assert failed.status_code == 500 and "a parallel step failed (RuntimeError)" in failed.text
    assert "injected device fault" not in failed.text
    assert health.status_code == 503
    assert "a parallel step failed" in health.json()["error"]["message"]


def test_sigterm_stops_every_rank_cleanly(wide: str) -> None:
    running = start_daemon("--model", wide, "--tensor-parallel-size", "2", "--expert-parallel")
    engine = engine_pid(running.proc.pid)
    rank = rank_pid(engine)
    assert complete(running.url, tokens(20, 90))["choices"][0]["finish_reason"] == "length"
    assert running.stop(signal.SIGTERM) == 0
    wait_until(lambda: gone(engine) and gone(rank), "the engine process and the rank to exit")


def test_a_size_that_splits_a_head_is_refused_at_startup(wide: str) -> None:
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--model", wide, "--no-kv-store",
                           "--tensor-parallel-size", "3", "--port", "0"],
                          cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 2
    assert "divide" in done.stderr.strip().splitlines()[-1]


STARTUP_SCRIPT = """
import sys, torch
from tests import faults
from v4serve.engine.model.parallel.sharding import ParallelConfig
from v4serve.engine.process.rank_group import RankGroup
RankGroup.spawn(ParallelConfig(2), getattr(faults, sys.argv[1]), torch.device("cpu"))
print("started")
"""


@pytest.mark.parametrize(("shard", "message"), [
    ("shard_failing_on_rank_1", "rank 1: injected: rank 1 cannot read its shard"),
    ("shard_dying_on_rank_1", "exit status 3"),  # the watchdog (or the broken collective) names it
])
def test_a_rank_failing_to_load_is_a_startup_error_never_a_hang(wide: str, shard: str, message: str) -> None:
    done = subprocess.run([sys.executable, "-c", STARTUP_SCRIPT, shard], cwd=ROOT, capture_output=True, text=True,
                          timeout=PATIENCE, env={**os.environ, "V4SERVE_TEST_CHECKPOINT": wide})
    assert done.returncode != 0 and "started" not in done.stdout
    assert message in done.stderr


def _exit_later(code: int) -> None:
    import time

    time.sleep(0.3)
    os._exit(code)


def test_a_broken_collective_names_the_worker_that_left_once_its_exit_is_seen() -> None:
    """The others hear a dying worker's connection close before its exit status can be read: the load's
    error waits (briefly) for that status instead of naming only the broken collective."""
    import multiprocessing

    from v4serve.engine.model.parallel.sharding import ParallelConfig
    from v4serve.engine.process.rank_group import RankGroup

    worker = multiprocessing.get_context("spawn").Process(target=_exit_later, args=(3,))
    worker.start()
    try:
        group = RankGroup(ParallelConfig(2), None, [worker])
        assert group.dead_rank() is None  # still running when the collective broke
        dead = group._dead_rank_within(PATIENCE)
        assert dead is not None and "exit status 3" in dead
        assert RankGroup(ParallelConfig(2), None, [])._dead_rank_within(PATIENCE) is None  # torchrun: no wait
    finally:
        worker.join(timeout=PATIENCE)


def test_torchrun_launches_the_ranks(wide: str, single: list[dict]) -> None:
    """Several nodes are launched with torchrun (one process per GPU; rank 0 serves HTTP): here both
    ranks on this machine, with torchrun's own rendezvous; rank 0 binds a port the system picks and
    says which in its log."""
    fd, name = tempfile.mkstemp(prefix="v4serve-torchrun-", suffix=".log", dir=os.environ.get("TMPDIR", "/tmp"))
    os.close(fd)
    log = open(name, "w")  # noqa: SIM115
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           "-m", "v4serve.server.cli", "serve", "--model", wide, "--tensor-parallel-size", "2", "--no-kv-store",
           "--host", "127.0.0.1", "--port", "0"]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        def serving() -> str | None:
            assert proc.poll() is None, f"torchrun exited with {proc.returncode}; see {name}"
            return served_at(Path(name).read_text(errors="replace"))

        wait_until(serving, "rank 0 to say where it serves")
        url = serving()
        assert url is not None

        def healthy() -> bool:
            assert proc.poll() is None, f"torchrun exited with {proc.returncode}; see {name}"
            try:
                return httpx.get(url + "/health", timeout=PATIENCE).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(healthy, "rank 0 to answer /health")
        out = greedy(url, PROMPTS)
        assert [o["tokens"] for o in out] == [s["tokens"] for s in single]
        assert httpx.get(url + "/version", timeout=PATIENCE).json()["tensor_parallel_size"] == 2
        proc.send_signal(signal.SIGTERM)  # torchrun passes it on to every rank, then exits non-zero itself
        proc.wait(timeout=PATIENCE)
        wait_until(lambda: not session_alive(proc.pid), "every rank to end")
        text = Path(name).read_text()
        assert "Application shutdown complete" in text and "could not tell every rank" not in text
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def session_alive(sid: int) -> bool:
    """A process of session `sid` still runs (zombies waiting to be reaped do not count)."""
    return any(int(fields[3]) == sid and fields[0] != "Z" for _, _, fields in processes())


def test_parallel_settings_that_cannot_work_are_refused() -> None:
    with pytest.raises(ValueError, match="--tensor-parallel-size 2 or more"):
        check_parallel_flags(ServeConfig(expert_parallel=True), None)
    with pytest.raises(ValueError, match="engine-in-process"):
        check_parallel_flags(ServeConfig(tensor_parallel_size=2, engine_in_process=True), None)
    with pytest.raises(ValueError, match="must agree"):
        check_parallel_flags(ServeConfig(tensor_parallel_size=2), LaunchedRank(0, 4, 0))
    with pytest.raises(ValueError, match="at least 1"):
        check_parallel_flags(ServeConfig(tensor_parallel_size=0), None)
    check_parallel_flags(ServeConfig(tensor_parallel_size=2), LaunchedRank(1, 2, 1))
    assert launched_rank({}) is None
    assert launched_rank({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "3"}) == LaunchedRank(3, 8, 3)
