"""The SSD store never serves a wrong byte: every kind of bad file is a counted, quarantined miss
whose request gives the cold tokens, with the good blocks before it still hit; a read that never
returns is a miss that holds up nothing; temp files of live writers survive a starting store; a
full disk pauses writing only until space is back; a reset removes what every daemon wrote; and the
namespace covers every byte of the weights. Real files; only a hung read and ENOSPC are injected."""

from __future__ import annotations

import errno
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.daemon import PATIENCE
from tests.helpers import SMALL, engine_for, greedy, small_model, tokens
from v4serve.cache import ssd_store
from v4serve.cache.ssd_file import (
    HEADER_BYTES,
    KIND_BLOCK,
    KIND_RESPONSE,
    KIND_SNAPSHOT,
    checksum,
    temp_is_stale,
    temp_name,
)
from v4serve.cache.ssd_store import SSDStore
from v4serve.engine.engine import kv_namespace
from v4serve.engine.model.v4.tiny import build_tiny, tiny_config
from v4serve.engine.model.weights.checkpoint import write_checkpoint
from v4serve.engine.model.weights.fingerprint import checkpoint_digest, tensors_digest

PROMPT = tokens(90, 4)  # 5 complete 16-token blocks of the small model, 90 > 80 so all 5 are reusable


def cold_output(model, prompt: list[int]) -> list[int]:
    return engine_for(model, enable_prefix_caching=False).generate([greedy("cold", prompt)])["cold"]


def populated(root: Path, mode: str = "full") -> dict[str, Path]:
    """Write PROMPT's blocks (and snapshots in `full` mode); → paths by name (blk0..4, snap0..4)."""
    engine = engine_for(small_model(), kv_store_dir=str(root), swa_cache_mode=mode)
    engine.generate([greedy("first", PROMPT)])
    engine.kv.store.flush(timeout=PATIENCE)
    hashes = engine.kv.hashes(PROMPT, None)
    paths = {f"blk{i}": engine.kv.store.path(KIND_BLOCK, h) for i, h in enumerate(hashes)}
    paths |= {f"snap{i}": engine.kv.store.path(KIND_SNAPSHOT, h) for i, h in enumerate(hashes)}
    engine.close()
    return paths


def namespace() -> bytes:
    """The small model's store namespace (what its engines write under)."""
    engine = engine_for(small_model(), kv_store_dir=None)
    return kv_namespace(small_model(), engine.config.kv_dtype, tensors_digest(small_model().state_dict().items()))


def restart(root: Path, **kw):
    kw.setdefault("kv_store_read_timeout", PATIENCE)  # no good file is a miss for being read slowly
    engine = engine_for(small_model(), kv_store_dir=str(root), swa_cache_mode="zero", **kw)
    req = greedy("again", PROMPT)
    engine.generate([req])
    engine.check()
    return req, engine


def rewrite_payload_length(path: Path, delta: int) -> None:
    """A well-formed file (valid checksum) whose payload is `delta` bytes off."""
    data = bytearray(path.read_bytes()[:-8])
    head = struct.Struct("<8sHB32s32sIIQ")
    fields = list(head.unpack_from(data))
    fields[-1] += delta
    data[: head.size] = head.pack(*fields)
    data = data[: len(data) + delta] if delta < 0 else data + bytes(delta)
    path.write_bytes(bytes(data) + struct.pack("<Q", checksum([bytes(data)])))


def flip(path: Path, at: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:at] + bytes([data[at] ^ 0xFF]) + data[at + 1:])


CORRUPTIONS = {
    # name: (how to spoil blk2, the error kind counted)
    "zero-length": (lambda p, paths: p.write_bytes(b""), "truncated"),
    "truncated": (lambda p, paths: p.write_bytes(p.read_bytes()[:200]), "truncated"),
    "flipped byte": (lambda p, paths: flip(p, -40), "checksum"),
    "garbage": (lambda p, paths: p.write_bytes(os.urandom(3000)), "format"),
    "another block's file": (lambda p, paths: shutil.copy(paths["blk0"], p), "collision"),
    "a snapshot under a block's name": (lambda p, paths: shutil.copy(paths["snap2"], p), "format"),
    "payload one byte short": (lambda p, paths: rewrite_payload_length(p, -1), "format"),
    "payload one byte long": (lambda p, paths: rewrite_payload_length(p, 1), "format"),
    "a directory": (lambda p, paths: (p.unlink(), p.mkdir()), "unreadable"),
    "a FIFO": (lambda p, paths: (p.unlink(), os.mkfifo(p)), "unreadable"),
    # Its own good bytes, but through a link: never followed (O_NOFOLLOW), so never served.
    "a symlink to its own bytes": (lambda p, paths: link_to(p, p.read_bytes()), "unreadable"),
    "a symlink to a huge sparse file": (lambda p, paths: link_to(p, sparse(p.parent / "big", 1 << 33)), "unreadable"),
    # Its own header, 8 GiB long: refused by its size before a byte past the header is read.
    "a huge sparse file": (lambda p, paths: sparse(p, 1 << 33, p.read_bytes()[:HEADER_BYTES]), "format"),
    "a header claiming 2^30 tokens": (lambda p, paths: rewrite_token_count(p, 1 << 30), "format"),
}


def link_to(path: Path, target: Path | bytes) -> None:
    """Replace `path` by a symlink to `target` (a file written outside the store's folders)."""
    if isinstance(target, bytes):
        (path.parent.parent.parent.parent / "elsewhere").write_bytes(target)
        target = path.parent.parent.parent.parent / "elsewhere"
    path.unlink()
    path.symlink_to(target)


def sparse(path: Path, size: int, head: bytes = b"") -> Path:
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def rewrite_token_count(path: Path, n_tok: int) -> None:
    data = bytearray(path.read_bytes())
    head = struct.Struct("<8sHB32s32sIIQ")
    fields = list(head.unpack_from(data))
    fields[5] = n_tok
    data[: head.size] = head.pack(*fields)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_bad_block_in_a_run_is_a_counted_quarantined_miss(tmp_path: Path, name: str) -> None:
    paths = populated(tmp_path)
    spoil, kind = CORRUPTIONS[name]
    spoil(paths["blk2"], paths)
    req, engine = restart(tmp_path)
    errors = engine.kv.store.stats_snapshot().errors
    quarantined = list((tmp_path / "quarantine").iterdir())
    engine.close()
    assert req.num_disk_hit_tokens == 32  # blocks 0 and 1 still hit; the bad third ends the prefix
    assert req.output_token_ids == cold_output(small_model(), PROMPT)
    assert errors[kind] == 1 and sum(errors.values()) == 1, errors
    assert len(quarantined) == 1 and quarantined[0].name.startswith(paths["blk2"].name)


def test_a_read_that_runs_out_of_memory_is_a_counted_quarantined_miss(tmp_path: Path, monkeypatch) -> None:
    """Injected: the buffer cannot be had (a MemoryError). It was a miss, but neither counted nor
    quarantined, so every later request tried the same file again."""
    paths = populated(tmp_path)
    read_file = SSDStore._read_file

    def no_memory_for_blk2(self: SSDStore, path: str | Path, kind: int, *rest: Any) -> bytearray:
        if Path(path) == paths["blk2"]:
            raise MemoryError
        return read_file(self, path, kind, *rest)

    monkeypatch.setattr(SSDStore, "_read_file", no_memory_for_blk2)
    req, engine = restart(tmp_path, kv_store_read_process=False)  # the fault is injected into this process
    errors = engine.kv.store.stats_snapshot().errors
    engine.close()
    assert req.num_disk_hit_tokens == 32 and req.output_token_ids == cold_output(small_model(), PROMPT)
    assert errors == {"unreadable": 1}
    assert [p.name.split(".")[0] for p in (tmp_path / "quarantine").iterdir()] == [paths["blk2"].stem]


def test_evicted_response_files_leave_no_empty_folders(tmp_path: Path) -> None:
    """One folder per prompt a response ended on: removed with its last file, by eviction, by a bad
    read and by a reset."""
    store = SSDStore(tmp_path, b"n" * 32, b"", {KIND_BLOCK: 8, KIND_RESPONSE: 8}, max_bytes=600)
    for i in range(30):
        assert store.put(KIND_RESPONSE, bytes([i]) * 32, [i, i + 1], [bytes(8)], parent=bytes([100 + i]) * 32)
        store.flush(timeout=PATIENCE)
    folders = [Path(d) for d, _, names in os.walk(store.dir / "resp")]
    kept = [f for f in folders if any(f.iterdir())]
    files = [f for f in (store.dir / "resp").rglob("*.resp")]
    assert 0 < len(files) < 30  # the bound evicted most of them
    assert folders == kept, [str(f) for f in folders if f not in kept]  # no empty folder left
    files[0].write_bytes(b"bad")
    parent = bytes.fromhex(files[0].parent.name)
    key = bytes.fromhex(files[0].name.split("-")[1].removesuffix(".resp"))
    assert store.responses(parent) and store.get(KIND_RESPONSE, key, None) is None  # quarantined
    assert not files[0].parent.exists()
    store.clear()
    assert [p for p in (store.dir / "resp").rglob("*")] == []
    store.close()


def test_a_block_under_a_snapshots_name_is_a_miss(tmp_path: Path) -> None:
    paths = populated(tmp_path)
    for i in range(5):  # every snapshot file holds a block: a restore point must come from elsewhere
        shutil.copy(paths[f"blk{i}"], paths[f"snap{i}"])
    engine = engine_for(small_model(), kv_store_dir=str(tmp_path), swa_cache_mode="full")
    req = greedy("again", PROMPT)
    engine.generate([req])
    errors = engine.kv.store.stats_snapshot().errors
    engine.close()
    assert req.output_token_ids == cold_output(small_model(), PROMPT)
    assert req.num_disk_hit_tokens == 80 and errors["format"] >= 1 and sum(errors.values()) == errors["format"]
    assert len(list((tmp_path / "quarantine").iterdir())) == errors["format"]  # each one read, moved aside


def test_a_file_unreadable_without_root_privileges(tmp_path: Path) -> None:
    """Root reads any file, so the reading store runs with root's file-permission override dropped
    (setpriv), like a daemon running as an ordinary user, and meets a file mode 000."""
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.fail("needs root and setpriv (util-linux) to drop the permission override, as CI has")
    paths = populated(tmp_path)
    paths["blk2"].chmod(0o000)
    probe = ("import sys; from v4serve.cache.ssd_store import SSDStore; from v4serve.cache.ssd_file import KIND_BLOCK\n"
             "s = SSDStore(sys.argv[1], bytes.fromhex(sys.argv[2]), b'', {KIND_BLOCK: 0})\n"
             "print(s.get(KIND_BLOCK, bytes.fromhex(sys.argv[3]), None), dict(s.stats_snapshot().errors))\n"
             "s.close()")
    drop = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]
    block_hash = paths["blk2"].name.removesuffix(".blk")
    done = subprocess.run([*drop, sys.executable, "-c", probe, str(tmp_path), namespace().hex(), block_hash],
                          capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("None ") and "'unreadable': 1" in done.stdout, done.stdout
    assert list((tmp_path / "quarantine").iterdir())


def test_a_read_that_never_returns_is_a_miss_and_holds_nothing_up(tmp_path: Path, monkeypatch) -> None:
    paths = populated(tmp_path, mode="zero")
    stuck, release = paths["blk2"], threading.Event()
    readers: list[threading.Thread] = []
    real_get = SSDStore.get

    def get(self, kind, block_hash, tokens, timings=None, **options):  # noqa: ANN001, ANN202, ANN003
        if self.path(kind, block_hash) == stuck:
            readers.append(threading.current_thread())
            release.wait(PATIENCE)  # a hung network file system (that gives up only if waited for)
        return real_get(self, kind, block_hash, tokens, timings, **options)

    monkeypatch.setattr(SSDStore, "get", get)
    try:
        # The short read timeout is the fault under test: a slow machine can only end the prefix
        # sooner (another run timing out, counted once all the same), never fail the request.
        req, engine = restart(tmp_path, kv_store_read_timeout=0.5, kv_store_read_process=False)
        errors = engine.kv.store.stats_snapshot().errors
        engine.close()  # the stuck reader is a daemon thread: nothing waits for it
        # Served and closed while the read is still stuck, so nothing waited for it: the order shows
        # it held nothing up, where a time bound would also fail a merely slow machine.
        (reader,) = readers
        assert reader.is_alive() and reader.daemon
    finally:
        release.set()
    assert req.output_token_ids == cold_output(small_model(), PROMPT)
    assert req.num_disk_hit_tokens < 80 and errors["timeout"] == 1


def test_a_starting_store_keeps_live_writers_temp_files(tmp_path: Path) -> None:
    populated(tmp_path, mode="zero")
    folder = next(tmp_path.rglob("*.blk")).parent
    # Another live daemon, alive until killed below (however long the test takes).
    writer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1e6)"])
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()  # a writer that died mid-write
    live_name = temp_name().replace(f"-{os.getpid()}-", f"-{writer.pid}-")
    files = {
        "ours": folder / temp_name(),
        "live writer": folder / live_name,
        "dead writer": folder / live_name.replace(f"-{writer.pid}-", f"-{ended.pid}-"),
        "other host": folder / ".tmp-otherhost-1-abc",
        "other host, old": folder / ".tmp-otherhost-2-abc",
        "unnamed writer": folder / ".tmp-deadbeef",
    }
    for path in files.values():
        path.write_bytes(b"half a file")
    old = time.time() - 2 * ssd_store.STALE_TEMP_SECONDS
    os.utime(files["other host, old"], (old, old))
    try:
        SSDStore(tmp_path, b"n" * 32, b"", {KIND_BLOCK: 1, KIND_SNAPSHOT: 1}).close()  # scans on start
        store = engine_for(small_model(), kv_store_dir=str(tmp_path))
        store.close()
        kept = {name for name, path in files.items() if path.exists()}
        assert kept == {"ours", "live writer", "other host"}
        writer.kill()
        writer.wait()
        engine_for(small_model(), kv_store_dir=str(tmp_path)).close()
        assert not files["live writer"].exists()  # its writer is gone now
    finally:
        writer.kill()
    assert temp_is_stale(".tmp-x", time.time(), 60)  # no writer in the name: left over


def test_writing_resumes_once_the_disk_has_room(tmp_path: Path, monkeypatch) -> None:
    real_open = open
    full = {"on": True}

    def no_space(path, mode="r", *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        if full["on"] and "w" in mode and ".tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_space)
    # The store's own clock, moved by hand: however slowly this machine runs request "a", its writes
    # stay paused (one failure, not one per elapsed retry period), and they resume exactly when the
    # retry period has passed.
    clock = types.SimpleNamespace(now=0.0, sleep=time.sleep)
    clock.monotonic = lambda: clock.now
    monkeypatch.setattr(ssd_store, "time", clock)
    engine = engine_for(small_model(), kv_store_dir=str(tmp_path), kv_store_retry_seconds=30.0)
    engine.generate([greedy("a", tokens(40, 30))])
    engine.kv.store.flush(timeout=PATIENCE)
    assert not engine.kv.store.writing and not list(tmp_path.rglob("*.blk"))
    full["on"] = False  # space is back
    clock.now += 29.0
    assert not engine.kv.store.writing  # the retry period has not passed
    clock.now += 2.0
    engine.generate([greedy("b", tokens(40, 31))])
    engine.kv.store.flush(timeout=PATIENCE)
    assert engine.kv.store.writing and len(list(tmp_path.rglob("*.blk"))) == 2
    assert engine.kv.store.stats_snapshot().errors["enospc"] == 1
    engine.close()


def test_reset_removes_what_every_daemon_sharing_the_folder_wrote(tmp_path: Path) -> None:
    model = small_model()
    a = engine_for(model, kv_store_dir=str(tmp_path))
    b = engine_for(model, kv_store_dir=str(tmp_path))
    a.generate([greedy("a", tokens(60, 32))])
    b.generate([greedy("b", tokens(60, 33))])
    a.kv.store.flush(timeout=PATIENCE)
    b.kv.store.flush(timeout=PATIENCE)
    def cache_files() -> list[Path]:
        return [f for suffix in ("blk", "snap", "resp") for f in tmp_path.rglob(f"*.{suffix}")]

    on_disk = len(cache_files())
    assert on_disk >= 8 and len(list(tmp_path.rglob("*.resp"))) == 2  # one response end per daemon
    dropped, removed = b.reset_prefix_cache(store=True)
    assert removed == on_disk and not cache_files()
    a.close()
    b.close()


def test_the_quarantine_folder_is_bounded(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ssd_store, "MAX_QUARANTINE_FILES", 3)
    populated(tmp_path)
    # A store expecting another layout finds every file bad: 5 errors, the newest 3 files kept.
    store = SSDStore(tmp_path, namespace(), b"another layout", {KIND_BLOCK: 1, KIND_SNAPSHOT: 1})
    for path in sorted(tmp_path.rglob("*.blk")):
        assert store.get(KIND_BLOCK, bytes.fromhex(path.name.removesuffix(".blk")), None) is None
    assert len(list((tmp_path / "quarantine").iterdir())) == 3 == store.quarantined
    assert store.stats_snapshot().errors["namespace"] == 5
    store.close()


# ---- the namespace covers every byte of the weights ---------------------------------------------------------
def test_one_changed_weight_changes_the_digest_and_the_namespace(tmp_path: Path) -> None:
    model = build_tiny(tiny_config(num_layers=2, compress_ratios=(0, 4)), seed=3)
    folder = write_checkpoint(model, tmp_path / "ckpt")
    cache = tmp_path / "digests.json"
    before = checkpoint_digest(folder, cache)
    assert checkpoint_digest(folder, cache) == before  # the cached digest, same answer
    tensors = load_file(folder / "model.safetensors")
    name = "layers.1.ffn.experts.0.w2.weight"
    tensors[name][3, 5] += 1e-3  # a fine-tune that moved one weight
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    assert checkpoint_digest(folder, cache) != before
    tuned = build_tiny(tiny_config(num_layers=2, compress_ratios=(0, 4)), seed=3)
    with torch.no_grad():
        tuned.state_dict()[name][3, 5] += 1e-3
    assert tensors_digest(tuned.state_dict().items()) != tensors_digest(model.state_dict().items())


def test_a_fine_tune_never_reads_the_base_models_kv(tmp_path: Path) -> None:
    base = small_model()
    engine = engine_for(base, kv_store_dir=str(tmp_path))
    engine.generate([greedy("a", PROMPT)])
    engine.close()
    tuned = build_tiny(tiny_config(**SMALL), seed=11)
    with torch.no_grad():
        tuned.state_dict()["layers.2.attn.wkv.weight"][0, 0] += 1e-4
    req = greedy("b", PROMPT)
    engine = engine_for(tuned, kv_store_dir=str(tmp_path))
    engine.generate([req])
    engine.close()
    assert req.num_disk_hit_tokens == 0 and req.num_hit_tokens == 0


