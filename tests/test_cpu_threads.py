"""`kernels.cpu_threads.run_pieces`: independent pieces spread over the intra-op threads, each piece's
ops single-threaded; and the indexer's prefill tiles run that way give the serial run's logits bitwise."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
import torch

from tests.helpers import engine_for, greedy, tiny_model, tokens
from v4serve.engine.model.v4 import attention
from v4serve.kernels.cpu_threads import run_pieces


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def test_every_piece_runs_once_on_single_threaded_ops_across_the_threads(two_threads: None) -> None:
    seen: list[tuple[int, int, int]] = []  # (piece, thread, its intra-op threads)
    lock = threading.Lock()

    def piece(i: int) -> None:
        with lock:
            seen.append((i, threading.get_ident(), torch.get_num_threads()))

    run_pieces([lambda i=i: piece(i) for i in range(7)])
    assert sorted(i for i, _, _ in seen) == list(range(7))
    assert {threads for _, _, threads in seen} == {1}
    assert len({thread for _, thread, _ in seen}) == 2
    assert torch.get_num_threads() == 2  # restored


def test_one_thread_runs_the_pieces_in_order_on_the_callers_thread() -> None:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen: list[tuple[int, int]] = []
        run_pieces([lambda i=i: seen.append((i, threading.get_ident())) for i in range(4)])
        assert seen == [(i, threading.get_ident()) for i in range(4)]
    finally:
        torch.set_num_threads(before)


def test_a_failing_piece_raises_once_every_piece_has_stopped(two_threads: None) -> None:
    done = []

    def fail() -> None:
        raise ValueError("piece 1")

    with pytest.raises(ValueError, match="piece 1"):
        run_pieces([lambda: done.append(0), fail, lambda: done.append(2), lambda: done.append(3)])
    assert sorted(done) == [0, 2]  # piece 3 shares the failed piece's thread, after it
    assert torch.get_num_threads() == 2


def test_the_callers_inference_mode_holds_in_every_piece(two_threads: None) -> None:
    with torch.inference_mode():
        out = torch.zeros(4)
        run_pieces([lambda i=i: out.__setitem__(i, i + 1.0) for i in range(4)])  # in place on an inference tensor
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_indexer_tiles_on_two_threads_give_the_serial_logits_bitwise(two_threads: None,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A prompt of 2,049 tokens: one 2,048-token chunk of eight tiles, then one token more (a tile of one)."""
    prompt, runs = tokens(2049, seed=47), {}
    spread: list[tuple[int, int]] = []  # (pieces, intra-op threads) of each threaded call
    for name, runner in (("serial", lambda pieces: [p() for p in pieces]), ("threads", run_pieces)):
        def counted(pieces, runner=runner, name=name) -> None:
            if name == "threads":
                spread.append((len(pieces), torch.get_num_threads()))
            runner(pieces)

        monkeypatch.setattr(attention, "run_pieces", counted)
        monkeypatch.setattr(attention, "THREADED_TILE_LOGITS", 0)  # whole tiles at any context
        engine = engine_for(tiny_model(), max_num_batched_tokens=2048, max_prefill_chunk=2048,
                            enable_prefix_caching=False)
        engine.add_request(greedy("r", prompt, n=4))
        engine.run_checked()
        engine.close()  # gives the process its threads back (decode steps run on one)
        runs[name] = torch.stack(engine.logits["r"])
    assert max(spread) == (8, 2)  # the chunk's eight tiles, on two threads
    assert torch.equal(runs["threads"], runs["serial"])


def test_short_contexts_keep_per_op_threads(two_threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """Below `THREADED_TILE_LOGITS` (a 2,048-token chunk sees 512 entries) per-op threads were faster."""
    calls: list[int] = []
    monkeypatch.setattr(attention, "run_pieces", lambda pieces: calls.append(len(pieces)))
    engine = engine_for(tiny_model(), max_num_batched_tokens=2048, max_prefill_chunk=2048, enable_prefix_caching=False)
    engine.add_request(greedy("r", tokens(2049, seed=48), n=2))
    engine.run_checked()
    engine.close()
    assert calls == []
    assert len(engine.logits["r"]) == 2
