"""The SSD prefix store: restart hits in every SWA mode, file faults as misses, full disks,
shared folders and hash collisions. Real files in a temporary folder; only ENOSPC is injected."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest

from tests.daemon import PATIENCE
from tests.helpers import engine_for, greedy, small_model, tiny_model, tokens
from v4serve.cache.ssd_file import FOOTER_BYTES, KIND_BLOCK, KIND_SNAPSHOT, checksum, decode, encode
from v4serve.cache.ssd_store import SSDStore

NS = b"n" * 32


def blk_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.blk"))


def cold_output(model, prompt: list[int], n: int = 6) -> list[int]:
    return engine_for(model, enable_prefix_caching=False).generate([greedy("cold", prompt, n)])["cold"]


def populate(model, root: Path, prompt: list[int], **kw) -> None:
    engine = engine_for(model, kv_store_dir=str(root), **kw)
    engine.generate([greedy("first", prompt)])
    engine.close()


def restarted_request(model, root: Path, prompt: list[int], **kw):
    # No good file is a miss for being read slowly (the store's 10 s read timeout).
    engine = engine_for(model, kv_store_dir=str(root), kv_store_read_timeout=PATIENCE, **kw)
    req = greedy("again", prompt)
    engine.generate([req])
    engine.check()
    engine.close()
    return req, engine


# ---- file format ------------------------------------------------------------------------------------


def test_encode_decode_round_trip_and_every_fault_is_named():
    toks = list(range(16))
    data = b"".join(bytes(p) for p in encode(KIND_BLOCK, NS, b"h" * 32, toks, b"L", [b"abc", b"de"]))
    assert bytes(decode(data, KIND_BLOCK, NS, b"h" * 32, toks, b"L", 5)) == b"abcde"
    cases = {
        "truncated": (data[:-3], KIND_BLOCK, NS, toks, b"L", 5),
        "checksum": (data[:60] + bytes([data[60] ^ 1]) + data[61:], KIND_BLOCK, NS, toks, b"L", 5),
        "namespace": (data, KIND_BLOCK, b"m" * 32, toks, b"L", 5),
        "collision": (data, KIND_BLOCK, NS, list(range(1, 17)), b"L", 5),
        "format": (b"garbage" * 20, KIND_BLOCK, NS, toks, b"L", 5),
    }
    for kind, (raw, file_kind, ns, tk, layout, length) in cases.items():
        with pytest.raises(Exception) as err:
            decode(raw, file_kind, ns, b"h" * 32, tk, layout, length)
        assert getattr(err.value, "kind", None) == kind, kind
    for wrong in ((KIND_SNAPSHOT, 5), (KIND_BLOCK, 4)):  # another kind of file; another payload length
        with pytest.raises(Exception) as err:
            decode(data, wrong[0], NS, b"h" * 32, toks, b"L", wrong[1])
        assert getattr(err.value, "kind", None) == "format"


# ---- restart hits --------------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", ["full", "periodic", "zero"])
@pytest.mark.parametrize("shared", [127, 128, 129, 256, 300])
def test_restart_serves_the_prefix_from_disk_with_cold_tokens(tmp_path, mode, shared):
    model = tiny_model()
    doc = tokens(400, 1)
    populate(model, tmp_path, doc, swa_cache_mode=mode, swa_checkpoint_interval=256)
    prompt = doc[:shared] + tokens(20, 2)
    req, engine = restarted_request(model, tmp_path, prompt, swa_cache_mode=mode, swa_checkpoint_interval=256)
    expected = shared // 128 * 128
    assert req.num_hit_tokens == expected and req.num_disk_hit_tokens == expected
    assert engine.scheduler.stats.prefix_hits_disk == expected
    assert req.output_token_ids == cold_output(model, prompt)
    if mode == "full":
        assert req.num_recomputed_tokens == 0  # the boundary's snapshot came from disk too


def test_store_writes_blocks_and_snapshots_per_mode(tmp_path):
    model = small_model()  # 16-token blocks
    prompt = tokens(100, 3)  # 6 full blocks
    written = {}
    for mode in ("full", "periodic", "zero"):
        root = tmp_path / mode
        populate(model, root, prompt, swa_cache_mode=mode, swa_checkpoint_interval=32)
        written[mode] = (len(blk_files(root)), len(list(root.rglob("*.snap"))))
    # The prompt's 6 blocks and the first generated token's block boundary stay below 112.
    assert written["full"] == (6, 6)
    assert written["periodic"] == (6, 3)  # at 32 and 64 (interval), 96 (interval and the prompt's end)
    assert written["zero"] == (6, 0)


# ---- faults ----------------------------------------------------------------------------------------------


def corrupt(path: Path, how: str) -> None:
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 2])
    elif how == "flipped":
        path.write_bytes(data[:-40] + bytes([data[-40] ^ 0xFF]) + data[-39:])
    elif how == "garbage":
        path.write_bytes(os.urandom(len(data)))
    elif how == "namespace":  # a well-formed file written for another model (valid checksum)
        body = data[:11] + bytes(32) + data[43:-8]
        path.write_bytes(body + struct.pack("<Q", checksum([body])))
    elif how == "unreadable":
        path.unlink()
        path.mkdir()


@pytest.mark.parametrize("how", ["truncated", "flipped", "garbage", "namespace", "unreadable"])
def test_a_bad_block_file_is_a_quarantined_miss(tmp_path, how):
    model = small_model()
    prompt = tokens(90, 4)
    populate(model, tmp_path, prompt, swa_cache_mode="zero")
    files = blk_files(tmp_path)
    engine0 = engine_for(model, kv_store_dir=str(tmp_path))
    third = engine0.kv.store.path(KIND_BLOCK, engine0.kv.hashes(prompt, None)[2])
    engine0.close()
    assert third in files
    corrupt(third, how)
    req, engine = restarted_request(model, tmp_path, prompt, swa_cache_mode="zero")
    assert req.num_disk_hit_tokens == 32  # blocks 0 and 1; the bad third ends the prefix
    assert req.output_token_ids == cold_output(model, prompt)
    errors = engine.kv.store.stats.errors
    kinds = {"flipped": "checksum", "garbage": "format"}
    assert errors[kinds.get(how, how)] == 1, errors
    assert any((tmp_path / "quarantine").iterdir())
    assert not third.exists() or third.is_file()  # moved aside (and rewritten once recomputed)


def test_stale_temp_files_are_removed_on_start(tmp_path):
    model = small_model()
    populate(model, tmp_path, tokens(40, 5))
    stale = blk_files(tmp_path)[0].parent / ".tmp-deadbeef"
    stale.write_bytes(b"half a file")
    engine = engine_for(model, kv_store_dir=str(tmp_path))
    engine.close()
    assert not stale.exists()


def test_hash_collision_never_serves_other_tokens(tmp_path):
    model = small_model()
    prompt, other = tokens(50, 6), tokens(50, 7)
    populate(model, tmp_path, other)
    engine = engine_for(model, kv_store_dir=str(tmp_path))
    # Force a collision: the file for prompt's first block hash now holds the other prompt's block.
    src = engine.kv.store.path(KIND_BLOCK, engine.kv.hashes(other, None)[0])
    dst = engine.kv.store.path(KIND_BLOCK, engine.kv.hashes(prompt, None)[0])
    engine.close()
    data = bytearray(src.read_bytes())
    data[43:75] = engine.kv.hashes(prompt, None)[0]  # claim the colliding hash (then fix the checksum)
    body = len(data) - 8
    data[body:] = struct.pack("<Q", checksum([bytes(data[:body])]))
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_bytes(bytes(data))
    req, engine = restarted_request(model, tmp_path, prompt)
    assert req.num_disk_hit_tokens == 0
    assert engine.kv.store.stats.errors["collision"] == 1
    assert req.output_token_ids == cold_output(model, prompt)


def test_full_disk_stops_writes_not_serving(tmp_path, monkeypatch):
    model = small_model()
    real_open = open

    def no_space(path, mode="r", *args, **kwargs):
        if "w" in mode and ".tmp-" in str(path):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr("builtins.open", no_space)
    engine = engine_for(model, kv_store_dir=str(tmp_path))
    prompt = tokens(60, 8)
    out = engine.generate([greedy("a", prompt)])["a"]
    engine.kv.store.flush(timeout=PATIENCE)
    assert not engine.kv.store.writing
    assert engine.kv.store.stats.errors["enospc"] == 1
    again = greedy("b", prompt)
    assert engine.generate([again])["b"] == out  # device cache and serving go on
    assert again.num_hit_tokens == 48
    engine.close()
    monkeypatch.undo()
    assert blk_files(tmp_path) == [] and not list(tmp_path.rglob(".tmp-*"))


def test_two_engines_share_one_folder(tmp_path):
    model = small_model()
    a = engine_for(model, kv_store_dir=str(tmp_path))
    b = engine_for(model, kv_store_dir=str(tmp_path), kv_store_read_timeout=PATIENCE)  # started before a wrote
    prompt = tokens(70, 9)
    a.generate([greedy("a", prompt)])
    a.kv.store.flush(timeout=PATIENCE)
    req = greedy("b", prompt[:66] + tokens(10, 10))
    b.generate([req])
    assert req.num_disk_hit_tokens == 64
    assert req.output_token_ids == cold_output(model, req.prompt_token_ids)
    a.close()
    b.close()


def test_size_bound_evicts_least_recently_used_files(tmp_path):
    model = small_model()
    probe = engine_for(model, kv_store_dir=str(tmp_path / "probe"))
    probe.generate([greedy("p", tokens(20, 11))])
    probe.close()
    size = blk_files(tmp_path / "probe")[0].stat().st_size
    root = tmp_path / "bounded"
    engine = engine_for(model, kv_store_dir=str(root), kv_store_max_bytes=3 * size, swa_cache_mode="zero")
    engine.generate([greedy("a", tokens(90, 12))])  # 5 blocks, only 3 fit
    engine.kv.store.flush(timeout=PATIENCE)
    assert len(blk_files(root)) == 3
    assert engine.kv.store.used_bytes <= 3 * size
    engine.close()


def test_reset_with_store_empties_the_folder(tmp_path):
    model = small_model()
    engine = engine_for(model, kv_store_dir=str(tmp_path))
    engine.generate([greedy("a", tokens(60, 13))])
    engine.kv.store.flush(timeout=PATIENCE)
    assert blk_files(tmp_path)
    engine.kv.reset_prefix_cache(store=True)
    assert blk_files(tmp_path) == [] and not list(tmp_path.rglob("*.snap"))
    assert engine.kv.store.contains(KIND_SNAPSHOT, b"x" * 32) is False
    engine.close()


def test_store_survives_a_foreign_file_layout(tmp_path):
    """A store written under another KV layout (another model) is never read as this one."""
    populate(small_model(), tmp_path, tokens(60, 14))
    other = SSDStore(tmp_path, b"z" * 32, b"other-layout", {KIND_BLOCK: 64, KIND_SNAPSHOT: 64})
    assert other.longest_prefix([b"a" * 32]) == 0
    other.close()


def test_a_disk_load_says_where_its_time_went(tmp_path, caplog) -> None:
    """Each load's phases (queue, read, verify, stack, wait, install) are observed once per load and
    logged at debug: the reads and checks take time, and a hit that reads nothing records no load."""
    import logging

    from v4serve.cache.ssd_loader import LOAD_PHASES

    model = small_model()
    prompt = tokens(100, 21)
    populate(model, tmp_path, prompt)
    with caplog.at_level(logging.DEBUG, logger="v4serve.engine.scheduler"):
        req, engine = restarted_request(model, tmp_path, prompt)
    phases = engine.scheduler.stats.load_phases
    assert req.num_disk_hit_tokens == 96 and set(phases) == set(LOAD_PHASES)
    assert all(sum(h.counts) == 1 for h in phases.values())
    assert phases["read"].total > 0 and phases["verify"].total > 0 and phases["install"].total > 0
    logged = [r.getMessage() for r in caplog.records if "from the SSD store in" in r.getMessage()]
    assert len(logged) == 1 and "6 blocks" in logged[0] and "verify" in logged[0]
    snapshot = engine.stats().store_load_phases
    assert {p: sum(h.counts) for p, h in snapshot.items()} == dict.fromkeys(LOAD_PHASES, 1)


def _store_with_blocks(tmp_path: Path, n: int) -> tuple[SSDStore, list[tuple[bytes, list[int]]]]:
    # The read-ahead under test is this process's (the reader process has its own: test_ssd_reader).
    store = SSDStore(tmp_path, b"n" * 32, b"layout", {KIND_BLOCK: 4096}, read_process=False)
    items = [(bytes([i]) * 32, [i, i + 1]) for i in range(n)]
    for i, (h, toks) in enumerate(items):
        assert store.put(KIND_BLOCK, h, toks, [bytes([i]) * 4096])
    store.flush(timeout=PATIENCE)
    return store, items


def test_files_in_the_page_cache_are_read_without_read_ahead(tmp_path, monkeypatch) -> None:
    """Just written, the files are in the page cache: the read-ahead thread (an extra open and close per
    file, contending for the interpreter) is not started."""
    store, items = _store_with_blocks(tmp_path, 6)
    asked: list[list[bytes]] = []
    monkeypatch.setattr(store, "_read_ahead", lambda kind, rest: asked.append([h for h, _ in rest]))
    payloads = store.get_many(KIND_BLOCK, items)
    store.close()
    assert [bytes(p) for p in payloads] == [bytes([i]) * 4096 for i in range(6)]
    assert asked == []


@pytest.mark.parametrize("nowait", ["eagain", "short", "unsupported"])
def test_the_first_file_not_in_the_page_cache_starts_the_read_ahead_of_the_rest(tmp_path, monkeypatch, nowait) -> None:
    """Injected: from the third file on, a read that may not wait gets nothing (EAGAIN), half a buffer,
    or is not supported by the file system. The rest of the files are read ahead once, from the one
    after the first such file; every payload is still read whole and checked."""
    import v4serve.cache.ssd_store as ssd_store

    store, items = _store_with_blocks(tmp_path, 6)
    asked: list[list[bytes]] = []
    monkeypatch.setattr(store, "_read_ahead", lambda kind, rest: asked.append([h for h, _ in rest]))
    cold = {os.fspath(store.path(KIND_BLOCK, h)) for h, _ in items[2:]}
    real_preadv = os.preadv

    def preadv(fd: int, buffers: list, offset: int, flags: int = 0) -> int:
        if flags and os.readlink(f"/proc/self/fd/{fd}") in cold:
            if nowait == "eagain":
                raise BlockingIOError(errno.EAGAIN, "would block")
            if nowait == "unsupported":
                raise OSError(errno.EOPNOTSUPP, "not supported")
            half = memoryview(buffers[0])[: len(buffers[0]) // 2]
            return real_preadv(fd, [half], offset)
        return real_preadv(fd, buffers, offset, flags)

    monkeypatch.setattr(ssd_store.os, "preadv", preadv)
    payloads = store.get_many(KIND_BLOCK, items)
    store.close()
    assert [bytes(p) for p in payloads] == [bytes([i]) * 4096 for i in range(6)]
    assert asked == [[h for h, _ in items[3:]]]
    assert store.stats.errors == {}


def test_a_payload_read_into_its_row_is_checked_as_a_whole_file_is(tmp_path) -> None:
    """Read apart (the payload straight into a row of the loading buffer), a file passes the same
    checks: a good one fills its row, one flipped payload byte is a quarantined checksum miss."""
    store, items = _store_with_blocks(tmp_path, 2)
    rows = bytearray(2 * 4096)
    views = [memoryview(rows)[:4096], memoryview(rows)[4096:]]
    path = store.path(KIND_BLOCK, items[1][0])
    data = bytearray(path.read_bytes())
    data[-FOOTER_BYTES - 100] ^= 1  # inside the payload
    path.write_bytes(data)
    payloads = store.get_many(KIND_BLOCK, items, into=views)
    store.close()
    assert len(payloads) == 1 and payloads[0].obj is rows and bytes(rows[:4096]) == bytes([0]) * 4096
    assert store.stats.errors == {"checksum": 1} and not path.exists()


def test_a_queued_disk_hit_reads_its_files_from_arrival_and_keeps_its_place(tmp_path) -> None:
    """One request at a time: B, a disk hit, arrives behind A and C (both cold). B's files are read
    while A runs, and B is still served after C (a read that finished early jumps no one); every
    output is a cold run's."""
    model = small_model()
    doc = tokens(96, 31)
    populate(model, tmp_path, doc)
    engine = engine_for(model, kv_store_dir=str(tmp_path), kv_store_read_timeout=PATIENCE, max_num_seqs=1)
    a, c, b = greedy("a", tokens(70, 32)), greedy("c", tokens(40, 34)), greedy("b", doc + tokens(5, 33))
    for req in (a, c, b):
        engine.add_request(req)
    assert b.kv.disk_load is not None  # reading from arrival, before any step
    firsts: dict[str, int] = {}
    step = 0
    while engine.has_work():
        engine.step()
        step += 1
        for req in (a, b, c):
            if req.output_token_ids and req.request_id not in firsts:
                firsts[req.request_id] = step
    engine.check()
    engine.close()
    assert sorted(firsts, key=firsts.get) == ["a", "c", "b"]
    assert b.num_disk_hit_tokens == 96
    for req in (a, b, c):
        assert req.output_token_ids == cold_output(model, req.prompt_token_ids), req.request_id
