"""Block Cache and State Cache bookkeeping: exact block ids, refcounts, eviction order, and the
integrity check after every step."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from v4serve.cache.block_pool import BlockPool, NoFreeBlocks, block_hashes, chain_hash, root_hash
from v4serve.cache.state_cache import HostSnapshots, SlotAllocator

H = [bytes([i]) * 32 for i in range(16)]  # stand-in chain hashes


def test_allocate_takes_lowest_free_ids_in_order():
    pool = BlockPool(6)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(3) == [2, 3, 4]
    assert (pool.num_free, pool.num_used, pool.num_cached) == (1, 5, 0)
    pool.check_integrity([[0, 1], [2, 3, 4]])
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    pool.check_integrity([[0, 1], [2, 3, 4]])  # a failed allocation takes nothing


def test_released_unsealed_blocks_are_reused_before_cached_ones():
    pool = BlockPool(4)
    a = pool.allocate(2)  # [0, 1]
    pool.seal(0, H[0])
    pool.release(reversed(a))  # 1 (unsealed) goes to the front, 0 (cached) to the back
    pool.check_integrity([])
    assert pool.num_cached == 1
    assert pool.allocate(1) == [1]
    assert pool.cached_block(H[0]) == 0  # not evicted while plain free blocks remain
    assert pool.allocate(2) == [2, 3]
    assert pool.allocate(1) == [0]  # now the cached block is evicted
    assert pool.cached_block(H[0]) is None
    assert pool.evictions == 1
    pool.check_integrity([[1], [2, 3], [0]])


def test_eviction_order_is_least_recently_released_and_prefix_tail_first():
    pool = BlockPool(6)
    t1 = pool.allocate(3)  # request 1: blocks 0,1,2
    t2 = pool.allocate(3)  # request 2: blocks 3,4,5
    for i, b in enumerate(t1):
        pool.seal(b, H[i])
    for i, b in enumerate(t2):
        pool.seal(b, H[8 + i])
    pool.release(reversed(t1))  # queue: 2, 1, 0
    pool.release(reversed(t2))  # queue: 2, 1, 0, 5, 4, 3
    pool.check_integrity([])
    assert pool.allocate(4) == [2, 1, 0, 5]
    assert pool.longest_prefix([H[0], H[1]]) == []
    assert pool.longest_prefix([H[8], H[9], H[10]]) == [3, 4]  # block 5 (H[10]) was evicted
    pool.check_integrity([[2, 1, 0, 5]])


def test_leaves_are_evicted_before_the_heads_they_hang_off():
    """Two conversations share a head block; the head was released first (least recently used), yet
    every leaf goes before it, and it goes only once nothing continues it."""
    pool = BlockPool(5)
    head, a1, a2 = pool.allocate(3)  # conversation A: head, a1, a2
    for block, h, parent in ((head, H[0], None), (a1, H[1], H[0]), (a2, H[2], H[1])):
        pool.seal(block, h, parent)
    pool.release([head])  # released early: the oldest in the queue
    (b1,) = pool.allocate(1)  # conversation B continues the same head
    pool.seal(b1, H[3], H[0])
    pool.release([a2, a1])
    pool.release([b1])
    pool.check_integrity([])
    assert pool.allocate(1) == [4]  # a plain free block first
    order = [pool.allocate(1)[0] for _ in range(4)]
    assert order == [a2, a1, b1, head]  # leaves (a2, then a1 once a2 was gone, then b1) before the head
    pool.check_integrity([[4], [a2], [a1], [b1], [head]])


def test_a_head_whose_children_are_in_use_goes_last():
    pool = BlockPool(3)
    head, child = pool.allocate(2)
    pool.seal(head, H[0])
    pool.seal(child, H[1], H[0])
    pool.release([head])  # the child stays in use: the head is still the only choice once space runs out
    assert pool.allocate(1) == [2]
    assert pool.allocate(1) == [head] and pool.cached_block(H[0]) is None
    pool.check_integrity([[child], [2], [head]])


def test_take_removes_cached_blocks_from_eviction_and_refcounts_add_up():
    pool = BlockPool(4)
    t1 = pool.allocate(2)
    pool.seal(t1[0], H[0])
    pool.seal(t1[1], H[1])
    hit = pool.longest_prefix([H[0], H[1], H[2]])
    assert hit == [0, 1]
    pool.take(hit)  # shared while the first owner still runs
    assert [pool.blocks[i].ref_count for i in (0, 1)] == [2, 2]
    pool.check_integrity([t1, hit])
    pool.release(reversed(t1))
    pool.check_integrity([hit])
    assert pool.allocate(2) == [2, 3]
    with pytest.raises(NoFreeBlocks):  # blocks held by a running request are never evicted
        pool.allocate(1)
    pool.check_integrity([hit, [2, 3]])
    pool.release(reversed(hit))
    pool.take([0])  # a cached block taken from the queue
    pool.check_integrity([[0], [2, 3]])


def test_seal_rules():
    pool = BlockPool(3)
    a, b = pool.allocate(1)[0], pool.allocate(1)[0]
    assert pool.seal(a, H[0]) is True
    assert pool.seal(b, H[0]) is False  # same content computed twice: the first stays findable
    assert pool.cached_block(H[0]) == a
    pool.release([b])
    assert pool.allocate(1) == [b]  # the duplicate is recycled as a plain free block
    with pytest.raises(ValueError):
        pool.take([b])  # only sealed blocks are shared
    with pytest.raises(ValueError):
        pool.seal(2, H[1])  # not in use
    pool.release([a])
    with pytest.raises(ValueError):
        pool.release([a])  # released more often than taken
    pool.check_integrity([[b]])


def test_reset_forgets_only_unreferenced_cached_blocks():
    pool = BlockPool(4)
    t = pool.allocate(2)
    pool.seal(t[0], H[0])
    pool.seal(t[1], H[1])
    pool.release([t[1]])
    assert pool.reset() == 1
    assert pool.cached_block(H[1]) is None
    assert pool.cached_block(H[0]) == t[0]  # still held: still valid and shared
    pool.check_integrity([[t[0]]])


def test_integrity_check_catches_a_refcount_that_does_not_match_the_tables():
    pool = BlockPool(3)
    t = pool.allocate(2)
    with pytest.raises(AssertionError):
        pool.check_integrity([t[:1]])


def test_random_workload_keeps_invariants():
    import random

    rng = random.Random(0)
    pool = BlockPool(32)
    tables: list[list[int]] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4 and pool.num_free:
            n = rng.randint(1, min(4, pool.num_free))
            table = pool.allocate(n)
            for b in table:
                if rng.random() < 0.5:
                    pool.seal(b, H[rng.randrange(16)] + bytes([step % 256]))
            tables.append(table)
        elif op < 0.6 and tables:
            src = rng.choice(tables)
            sealed = [b for b in src if pool.blocks[b].block_hash is not None]
            if sealed:
                pool.take(sealed)
                tables.append(list(sealed))
        elif tables:
            pool.release(reversed(tables.pop(rng.randrange(len(tables)))))
        pool.check_integrity(tables)


def test_hash_chain_depends_on_every_earlier_token_and_the_salt():
    root = root_hash(b"ns", None)
    toks = list(range(40))
    hs = block_hashes(root, toks, 16)
    assert len(hs) == 2  # only complete blocks
    assert hs[0] == chain_hash(root, toks[:16])
    assert hs[1] == chain_hash(hs[0], toks[16:32])
    changed = block_hashes(root, [99] + toks[1:], 16)
    assert changed[0] != hs[0] and changed[1] != hs[1]
    assert block_hashes(root_hash(b"ns", "tenant-b"), toks, 16)[0] != hs[0]
    assert block_hashes(root_hash(b"other-model", None), toks, 16)[0] != hs[0]
    assert chain_hash(root, [1, 23]) != chain_hash(root, [12, 3])


def test_chain_hash_is_sha256_of_the_parent_and_the_ids_as_little_endian_int64_whatever_holds_them():
    """The SSD store's file names and the routers' KV events are these hashes: what is hashed must stay
    `parent, NUL, ids as <q` for every kind of sequence a block's tokens come in, on any machine."""
    import hashlib
    from array import array

    import numpy as np

    parent = bytes(range(32))
    ids = [0, 7, 129279, 42, 1 << 40]
    packed = b"".join(t.to_bytes(8, "little") for t in ids)
    expected = hashlib.sha256(parent + b"\0" + packed).digest()
    holders = [ids, tuple(ids), array("q", ids), array("Q", ids), list(array("q", ids)),
               [np.int64(t) for t in ids], np.array(ids, dtype=np.int64)]
    for held in holders:
        assert chain_hash(parent, held) == expected, type(held)
    assert chain_hash(parent, []) == chain_hash(parent, range(0)) == hashlib.sha256(parent + b"\0").digest()
    assert root_hash(b"ns", "salt") == hashlib.sha256(b"v4serve-root-2\0ns\0salt").digest()
    assert root_hash(b"ns", None) == root_hash(b"ns", "") != root_hash(b"ns", "salt")


def test_slot_allocator():
    slots = SlotAllocator(3)
    assert [slots.allocate(), slots.allocate()] == [0, 1]
    slots.free(0)
    assert slots.allocate() == 0
    assert slots.allocate() == 2
    assert slots.allocate() is None
    with pytest.raises(ValueError):
        slots.free(7)
    slots.check_integrity()


def test_snapshot_store_is_bounded_lru():
    store: HostSnapshots[str] = HostSnapshots(max_bytes=100)
    assert store.put(b"a", "A", 40) and store.put(b"b", "B", 40)
    assert store.get(b"a") == "A"  # a is now most recent
    assert store.put(b"c", "C", 40)  # evicts b
    assert b"b" not in store and b"a" in store and b"c" in store
    assert store.used_bytes == 80 and store.evictions == 1
    assert not store.put(b"d", "D", 101)


def test_bookkeeping_modules_do_not_import_torch():
    for name in ("block_pool.py", "config.py", "state_cache.py", "request_kv.py", "kv_manager.py", "ssd_loader.py",
                 "ssd_store.py", "layout.py"):
        tree = ast.parse((Path(__file__).parents[1] / "cache" / name).read_text())
        imported = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert "torch" not in imported, name
