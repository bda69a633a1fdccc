"""Host memory that blocks read from the SSD store land in (`HostRows`, `DeviceKV.block_rows` on a CPU):
kept from load to load, and never handed to a load while anything made on it from an earlier one is
alive."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from tests.helpers import engine_for, greedy, small_model
from v4serve.cache import device_kv
from v4serve.cache.device_kv import HostRows


def test_a_kept_buffer_is_taken_again_only_once_nothing_made_on_it_is_alive() -> None:
    rows = HostRows()
    first = rows.take(1000)
    kept = first.data_ptr()
    second = rows.take(1000)  # the first is held: another buffer
    assert second.data_ptr() != kept
    third = rows.take(500)  # both kept buffers held (KEEP = 2): memory of its own
    assert third.data_ptr() not in (kept, second.data_ptr())
    view = first[:12].view(2, 6).view(torch.int16)  # a view outlives the tensor it was made from
    del first
    assert rows.take(100).data_ptr() not in (kept, second.data_ptr())
    del view
    again = rows.take(800)
    assert again.data_ptr() == kept
    del again, second, third
    grown = rows.take(5000)  # larger than any kept buffer: a free one is replaced by a larger one
    assert grown.numel() == 5000 and len(rows._kept) == 2 and max(len(b) for b in rows._kept) == 5000
    assert rows.take(0).numel() == 0  # a load of no blocks (only a response end)


def test_a_reserved_buffer_serves_the_first_load() -> None:
    rows = HostRows()
    rows.reserve(4096)
    kept = torch.frombuffer(rows._kept[0], dtype=torch.uint8).data_ptr()  # a reference held here would keep it taken
    assert rows.take(4000).data_ptr() == kept


def test_two_loads_at_once_never_share_a_buffer() -> None:
    rows = HostRows()
    rows.reserve(1 << 16)

    def load(start: threading.Barrier, taken: list[torch.Tensor]) -> None:
        start.wait()
        taken.append(rows.take(1 << 15))

    for _ in range(20):
        start, taken = threading.Barrier(2), []
        threads = [threading.Thread(target=load, args=(start, taken)) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert taken[0].data_ptr() != taken[1].data_ptr()


def test_disk_hits_one_after_another_reuse_the_rows_and_give_the_cold_tokens(tmp_path: Path, monkeypatch) -> None:
    """Two documents loaded from the store by one engine (as after a restart): the second load lands in the
    memory the first one did (installed and let go by then), and each gives its cold run's tokens."""
    model = small_model()
    b = model.cfg.block_size
    docs = [[(7 * i + 3 * d) % 200 + 10 for i in range(6 * b + 5)] for d in range(2)]
    settings = dict(kv_store_dir=str(tmp_path), max_model_len=8 * b)
    cold = engine_for(model, **settings)
    want = [cold.generate([greedy(f"c{d}", doc)])[f"c{d}"] for d, doc in enumerate(docs)]
    cold.close()
    engine = engine_for(model, **settings)
    assert [len(buf) for buf in engine.device_kv._host_rows._kept] == [8 * engine.device_kv.block_nbytes()]
    landed: list[int] = []
    blocks_from_rows = device_kv.DeviceKV.blocks_from_rows

    def spy(self: device_kv.DeviceKV, rows: torch.Tensor, n: int) -> list[torch.Tensor]:
        landed.append(rows.data_ptr())
        return blocks_from_rows(self, rows, n)

    monkeypatch.setattr(device_kv.DeviceKV, "blocks_from_rows", spy)
    try:
        hits = [greedy(f"h{d}", doc) for d, doc in enumerate(docs)]
        got = [engine.generate([hit])[hit.request_id] for hit in hits]
    finally:
        engine.close()
    assert got == want and [hit.num_disk_hit_tokens for hit in hits] == [6 * b, 6 * b]
    assert len(landed) == 2 and landed[0] == landed[1]


def test_install_copies_each_block_to_its_id_in_runs_or_scattered() -> None:
    """`install_blocks`: block j lands at ids[j] whether the ids run in order (slice copies) or are
    scattered (one index copy), and nothing else is written."""
    from v4serve.cache.device_kv import _id_runs
    from v4serve.engine.engine import EngineConfig, LLMEngine

    assert _id_runs([3, 4, 5, 9, 10, 2]) == [(3, 0, 3), (9, 3, 2), (2, 5, 1)]
    engine = LLMEngine(small_model(), EngineConfig(max_model_len=1024, max_num_seqs=2))
    try:
        kv = engine.device_kv
        rows, _ = kv.block_rows(12)
        rows.copy_(torch.randint(0, 256, rows.shape, generator=torch.Generator().manual_seed(5), dtype=torch.uint8))
        stacked = kv.blocks_from_rows(rows, 12)
        in_runs = [*range(3, 9), *range(20, 26)]
        scattered = [30, 2, 17, 40, 11, 35, 1, 28, 44, 9, 19, 38]  # 12 runs: more than MAX_COPY_RUNS
        for ids in (in_runs, scattered):
            for part in kv._block_parts():
                part.zero_()
            kv.install_blocks(ids, stacked)
            for part, src in zip(kv._block_parts(), stacked, strict=True):
                assert torch.equal(part[ids].view(torch.uint8), src.contiguous().view(torch.uint8))  # NaN bits too
                others = [i for i in range(part.shape[0]) if i not in ids]
                assert not part[others].any()
    finally:
        engine.close()


def test_a_copy_of_the_kv_tensors_gets_host_rows_of_its_own() -> None:
    import copy
    import pickle

    rows = HostRows()
    rows.reserve(4096)
    for twin in (copy.deepcopy(rows), pickle.loads(pickle.dumps(rows))):
        assert twin is not rows and twin._kept == [] and twin.take(100).numel() == 100
