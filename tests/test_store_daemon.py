"""The SSD prefix store through the real daemon: a restart between two requests serves the
shared prefix from disk (usage and metrics say so) with the cold run's greedy tokens in every
SWA mode; bad files, a full disk and a shared folder never stop serving."""

from __future__ import annotations

import contextlib
import re
import signal
import struct
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.daemon import PATIENCE, daemon, start_daemon, wait_until
from tests.helpers import tokens

DOC = tokens(760, 21)
QUESTION = tokens(30, 22)


def complete(url: str, prompt: list[int], n: int = 8) -> dict:
    body = {"prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    resp = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE)
    assert resp.status_code == 200, resp.text
    return resp.json()


def output_tokens(result: dict) -> list[str]:
    return result["choices"][0]["logprobs"]["tokens"]


def wait_for_metric(url: str, name: str, value: float, timeout: float = PATIENCE) -> float:
    """The metric once it reaches `value` (files read in the background may land a moment after
    the response), or its last reading after the timeout."""
    deadline = time.monotonic() + timeout
    while (found := metric(url, name)) < value and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


def block_position(path: Path, sequence: list[int]) -> int:
    """Where a block file's tokens sit in `sequence` (read from its header); past the end if
    they are not in it (a block ending in generated tokens)."""
    data = path.read_bytes()
    head = struct.calcsize("<8sHB32s32sIIQ")
    block = struct.unpack_from("<128i", data, head)
    return next((i for i in range(0, len(sequence), 128) if tuple(sequence[i:i + 128]) == block), len(sequence))


def metric(url: str, name: str, **labels: str) -> float:
    text = httpx.get(url + "/metrics", timeout=PATIENCE).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', line.split(" ")[0]))
        if all(found.get(k) == v for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def cold() -> dict[int, list[str]]:
    """Reference outputs from a daemon that caches nothing."""
    with daemon("--no-prefix-caching") as url:
        return {shared: output_tokens(complete(url, DOC[:shared] + QUESTION)) for shared in (640, 641, 700)}


@pytest.mark.parametrize(("mode", "shared"), [("full", 640), ("periodic", 700), ("zero", 641)])
def test_restart_serves_from_disk_with_cold_tokens(tmp_path, cold, mode, shared):
    args = ("--kv-store-dir", str(tmp_path), "--swa-cache-mode", mode, "--swa-checkpoint-interval", "256")
    with daemon(*args) as url:
        complete(url, DOC + tokens(10, 23))
    with daemon(*args) as url:
        result = complete(url, DOC[:shared] + QUESTION)
        disk_hits = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
        read_bytes = metric(url, "v4serve_kv_store_read_bytes_total")
        loads = metric(url, "v4serve_kv_store_read_seconds_count")
    assert output_tokens(result) == cold[shared]
    usage = result["usage"]
    assert disk_hits == 640 and read_bytes > 0 and loads == 1
    # full: the snapshot at 640; periodic: the latest at or below 640 is 512 (every 256 tokens and
    # 768 at the first prompt's end); zero: recompute (window-1)·layers = 127·4 tokens.
    resume = {"full": 640, "periodic": 512, "zero": 640 - 508}[mode]
    assert usage["prompt_tokens_details"]["cached_tokens"] == resume
    assert usage["prompt_cache_hit_tokens"] + usage["prompt_cache_miss_tokens"] == usage["prompt_tokens"]


def test_bad_files_are_misses_and_the_daemon_keeps_serving(tmp_path, cold):
    args = ("--kv-store-dir", str(tmp_path), "--swa-cache-mode", "zero")
    first = DOC + tokens(10, 24)
    with daemon(*args) as url:
        complete(url, first)
    files = sorted(tmp_path.rglob("*.blk"), key=lambda p: block_position(p, first))
    assert len(files) == 6  # 770 prompt tokens + 7 computed outputs: six full 128-token blocks
    victim = files[3]
    data = victim.read_bytes()
    victim.write_bytes(data[:100] + bytes([data[100] ^ 0xFF]) + data[101:])  # flipped byte
    files[4].write_bytes(b"not a store file at all")  # garbage
    (victim.parent / ".tmp-leftover").write_bytes(b"partial")  # a crash mid-write
    with daemon(*args) as url:
        result = complete(url, DOC[:641] + QUESTION)
        errors = wait_for_metric(url, "v4serve_kv_store_errors_total", 1)
        disk_hits = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
        again = complete(url, tokens(50, 25))  # still serving
    assert output_tokens(result) == cold[641]
    assert disk_hits == 3 * 128  # blocks 0..2; the flipped fourth ends the prefix
    # The flipped file is quarantined; the files are read in order, so the garbage one after it is not
    # read (a later read that reaches it finds it bad in turn).
    assert errors == 1
    assert again["choices"][0]["finish_reason"] == "length"
    assert not (victim.parent / ".tmp-leftover").exists()
    assert [p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir()] == [victim.name.split(".")[0]]


def test_two_daemons_share_one_store_folder(tmp_path, cold):
    args = ("--kv-store-dir", str(tmp_path), "--swa-cache-mode", "periodic", "--swa-checkpoint-interval", "256")
    with daemon(*args) as first, daemon(*args) as second:
        complete(first, DOC + tokens(10, 26))
        # The first daemon writes in the background.
        wait_until(lambda: len(list(tmp_path.rglob("*.blk"))) >= 6, "the first daemon's six block files")
        result = complete(second, DOC[:700] + QUESTION)  # written by the other daemon
        disk_hits = metric(second, "v4serve_prefix_cache_hits_total", source="disk")
    assert output_tokens(result) == cold[700]
    assert disk_hits == 640


def test_daemons_in_different_swa_modes_share_one_store(tmp_path, cold):
    """An `auto` daemon writes nothing for a document until it is hit; then it snapshots the hit's
    boundary, on disk too. A `zero` daemon on the same folder restores there (it writes no snapshots,
    but uses every one it finds) and gives the cold run's tokens."""
    store = ("--kv-store-dir", str(tmp_path))
    with daemon(*store, "--swa-cache-mode", "auto") as first:
        complete(first, DOC + tokens(10, 27))
        assert metric(first, "v4serve_swa_snapshot_bytes_total", tier="disk") == 0  # cold: nothing written
        again = complete(first, DOC[:700] + tokens(30, 28))  # the document's first hit: recomputed, now hot
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == 640 - 508
        wait_until(lambda: metric(first, "v4serve_swa_snapshot_bytes_total", tier="disk") > 0, "the hot snapshots")
    with daemon(*store, "--swa-cache-mode", "zero") as second:
        result = complete(second, DOC[:700] + QUESTION)
    assert output_tokens(result) == cold[700]
    assert result["usage"]["prompt_tokens_details"]["cached_tokens"] == 640  # restored at the hit's boundary


def test_full_disk_stops_writes_not_serving(tmp_path, cold):
    """A real full filesystem: a 96 KiB tmpfs (mounting needs root, as `make test` runs in CI)."""
    mount = tmp_path / "tiny-disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True)
    assert done.returncode == 0, f"cannot mount a tmpfs (needs root): {done.stderr.decode()}"
    try:
        with daemon("--kv-store-dir", str(mount), "--swa-cache-mode", "full") as url:
            first = complete(url, DOC[:641] + QUESTION)
            errors = metric(url, "v4serve_kv_store_errors_total", kind="enospc")
            second = complete(url, DOC[:641] + QUESTION)
            third = complete(url, tokens(40, 27))
        assert output_tokens(first) == cold[641] == output_tokens(second)
        assert errors == 1
        assert second["usage"]["prompt_tokens_details"]["cached_tokens"] == 640  # the device cache goes on
        assert third["choices"][0]["finish_reason"] == "length"
        assert not list(Path(mount).rglob(".tmp-*"))
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_concurrent_scrapes_count_every_store_error_exactly_once(tmp_path):
    """Bad files read on the store's threads while requests run and several clients scrape /metrics:
    the error counter ends at exactly the number of files quarantined (read off the disk) and no
    scrape ever sees it go backwards."""
    args = ("--kv-store-dir", str(tmp_path), "--swa-cache-mode", "zero")
    docs = [tokens(300, 40 + i) for i in range(6)]
    with daemon(*args) as url:
        for doc in docs:
            complete(url, doc, n=2)
        # Written in the background.
        wait_until(lambda: len(list(tmp_path.rglob("*.blk"))) >= 2 * len(docs), "two block files per document")
    for doc in docs:  # each document's second block file gets a flipped byte
        (victim,) = [p for p in tmp_path.rglob("*.blk") if block_position(p, doc) == 128]
        data = victim.read_bytes()
        victim.write_bytes(data[:-10] + bytes([data[-10] ^ 0xFF]) + data[-9:])
    with daemon(*args) as url:
        stop, seen = threading.Event(), [[] for _ in range(3)]

        def scrape(out: list[float]) -> None:
            while not stop.is_set():
                out.append(metric(url, "v4serve_kv_store_errors_total"))

        scrapers = [threading.Thread(target=scrape, args=(s,)) for s in seen]
        for t in scrapers:
            t.start()
        with ThreadPoolExecutor(len(docs)) as pool:
            results = list(pool.map(lambda d: complete(url, d + tokens(20, 60), n=3), docs))
        errors = wait_for_metric(url, "v4serve_kv_store_errors_total", len(docs))
        time.sleep(0.5)  # a double count would likely show by now (a busy machine can only hide one, not fake one)
        # Every scraper has read the counter several times (however slowly the machine answers).
        wait_until(lambda: all(len(s) > 3 for s in seen), "every scraper to read the counter several times")
        stop.set()
        for t in scrapers:
            t.join(timeout=PATIENCE)
        final = metric(url, "v4serve_kv_store_errors_total")
        disk_hits = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
    quarantined = list((tmp_path / "quarantine").iterdir())
    assert len(quarantined) == len(docs) == errors == final
    assert all(len(s) > 3 and s == sorted(s) for s in seen)  # every scraper saw a counter that only rose
    assert disk_hits == 128 * len(docs)  # each first block from disk; the flipped second ends the prefix
    assert all(r["choices"][0]["finish_reason"] == "length" for r in results)


def test_kill_9_during_heavy_store_writes_serves_nothing_corrupt(tmp_path):
    """A daemon killed mid-write: the next one cleans the dead writer's temp files up and serves
    the cold tokens for every prompt, from whatever files did land."""
    docs = [tokens(1500, 70 + i) for i in range(4)]
    with daemon("--no-prefix-caching") as url:
        cold = [output_tokens(complete(url, doc + QUESTION)) for doc in docs]
    args = ("--kv-store-dir", str(tmp_path), "--swa-cache-mode", "full")
    running = start_daemon(*args)

    def send(doc: list[int]) -> None:
        with contextlib.suppress(httpx.HTTPError):  # the daemon dies under it
            httpx.post(running.url + "/v1/completions", json={"prompt": doc, "max_tokens": 4}, timeout=PATIENCE)

    senders = [threading.Thread(target=send, args=(doc,)) for doc in docs]
    for t in senders:
        t.start()
    deadline = time.monotonic() + PATIENCE  # then killed anyway: whatever has landed is what is checked
    while len(list(tmp_path.rglob("*.snap"))) < 8 and time.monotonic() < deadline:
        time.sleep(0.01)
    running.stop(signal.SIGKILL)  # mid-write: snapshots (216 KiB each) and blocks still queued
    for t in senders:
        t.join(timeout=PATIENCE)
    with daemon(*args) as url:
        assert not list(tmp_path.rglob(".tmp-*"))  # the dead writer's leftovers are gone
        results = [output_tokens(complete(url, doc + QUESTION)) for doc in docs]
        errors = metric(url, "v4serve_kv_store_errors_total")
        disk_hits = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
    assert results == cold
    assert errors == 0 and disk_hits > 0  # what landed was whole; what did not was a plain miss


# Only lowercase ASCII letters (byte tokens 64 + 97..122) are likely: replies round-trip through text exactly.
LETTERS = {str(64 + c): 30 for c in range(ord("a"), ord("z") + 1)}


def test_a_conversation_resumes_after_a_restart_computing_only_new_tokens(tmp_path):
    """Five turns through both endpoints (completions with token ids, chat with messages), a restart
    on the same store folder, then turn six: every follow-up reports all but its new tokens cached."""
    args = ("--kv-store-dir", str(tmp_path))
    history: list[int] = []
    answered: list[int] = []  # the conversation up to the end of the last reply
    messages: list[dict] = []
    with daemon(*args) as url:
        for t in range(5):
            history += tokens(150 + 37 * t, 60 + t)
            reply = httpx.post(url + "/v1/completions", json={
                "prompt": history, "max_tokens": 20 + t, "temperature": 0, "ignore_eos": True, "logprobs": 0,
                "logit_bias": LETTERS}, timeout=PATIENCE).json()
            if t:  # all but the new tokens and the previous reply's last token (never computed)
                assert reply["usage"]["prompt_tokens_details"]["cached_tokens"] == len(answered) - 1, t
            history += [64 + ord(c) for c in reply["choices"][0]["logprobs"]["tokens"]]
            answered = list(history)
        computed = 0  # tokens the previous chat turn computed: its prompt and reply but the last token
        for t in range(3):
            messages.append({"role": "user", "content": f"question {t}: " + "x" * (90 * t + 5)})
            reply = httpx.post(url + "/v1/chat/completions", json={
                "messages": messages, "max_tokens": 25, "temperature": 0, "logit_bias": LETTERS},
                timeout=PATIENCE).json()
            usage = reply["usage"]
            if t:  # the new prompt renders the old one, the reply and EOS, then the new question
                assert usage["prompt_tokens_details"]["cached_tokens"] == computed, t
            computed = usage["prompt_tokens"] + usage["completion_tokens"] - 1
            messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"]})
    history += tokens(64, 70)
    body = {"prompt": history, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "logprobs": 0}
    with daemon(*args) as url:
        after = complete_with(url, body)
        disk_hits = metric(url, "v4serve_prefix_cache_hits_total", source="disk")
        restores = metric(url, "v4serve_prefix_cache_restores_total", point="response_end")
    with daemon("--no-prefix-caching") as url:
        cold_reply = complete_with(url, body)
    assert after["usage"]["prompt_tokens_details"]["cached_tokens"] == len(answered) - 1
    assert disk_hits == (len(answered) - 1) // 128 * 128 and restores == 1
    assert output_tokens(after) == output_tokens(cold_reply)


def complete_with(url: str, body: dict) -> dict:
    resp = httpx.post(url + "/v1/completions", json=body, timeout=PATIENCE)
    assert resp.status_code == 200, resp.text
    return resp.json()
