"""Agent conversations: a follow-up turn (the whole conversation so far plus new tokens) resumes
exactly where the previous response ended, through an end-of-response snapshot, and gives the cold
run's tokens; it falls back to the sealed boundary when the new prompt diverges inside the tail.
State-level checks: the restored slot equals a cold run's slot at the same position, for sealed
snapshots, end-of-response snapshots and the zero-mode recompute alike."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import engine_for, greedy, small_model, tiny_model, tokens
from v4serve.cache.ssd_file import KIND_BLOCK
from v4serve.engine.model.parallel.single import SingleSequence

B = 16  # the small model's block (ratios 4 and 16); window 8


def cold(model, prompt: list[int], n: int = 6) -> list[int]:
    return cold_run(model, prompt, n)[0]


def cold_run(model, prompt: list[int], n: int = 6) -> tuple[list[int], torch.Tensor]:
    """A cold run's tokens and the logits of each decision."""
    engine = engine_for(model, enable_prefix_caching=False)
    out = engine.generate([greedy("cold", prompt, n)])["cold"]
    return out, torch.stack(engine.logits["cold"])


def turn(engine, rid: str, prompt: list[int], n: int):
    request = greedy(rid, prompt, n)
    engine.generate([request])
    engine.check()
    return request


@pytest.mark.parametrize("mode", ["full", "periodic"])
@pytest.mark.parametrize("end", [31, 32, 33, 37, 45, 47, 48, 49])  # where turn 1's response ends (p)
@pytest.mark.parametrize("n_out", [1, 5])
def test_the_next_turn_resumes_where_the_response_ended(mode: str, end: int, n_out: int) -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=64)
    first = turn(engine, "t1", tokens(end - n_out + 1, end), n_out)  # computes `end` tokens
    assert first.num_computed_tokens == end
    prompt = first.all_token_ids + tokens(9, 100 + end)
    second = turn(engine, "t2", prompt, 6)
    assert second.num_cached_tokens == end  # everything but the new tokens and the last output token
    assert second.num_recomputed_tokens == 0
    out, logits = cold_run(model, prompt)
    assert second.output_token_ids == out
    torch.testing.assert_close(torch.stack(engine.logits["t2"]), logits, rtol=0, atol=1e-4)


@pytest.mark.parametrize("mode", ["full", "periodic"])
def test_a_prompt_that_diverges_inside_the_tail_falls_back_to_the_block(mode: str) -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=16)
    first = turn(engine, "t1", tokens(40, 1), 5)  # ends at 44: tail 32..44
    edited = list(first.prompt_token_ids[:38]) + tokens(12, 2)  # the history was edited at 38, inside the tail
    second = turn(engine, "t2", edited, 6)
    assert second.num_cached_tokens == 32  # the sealed boundary before the tail (snapshots every block)
    assert second.output_token_ids == cold(model, edited)
    before = turn(engine, "t3", list(first.prompt_token_ids[:20]) + tokens(30, 3), 6)  # diverges before it
    assert before.num_cached_tokens == 16
    assert before.output_token_ids == cold(model, before.prompt_token_ids)


def test_a_conversation_of_six_turns_computes_only_new_tokens() -> None:
    model = tiny_model()  # 128-token blocks, window 128
    engine = engine_for(model, swa_cache_mode="periodic", swa_checkpoint_interval=512)
    history: list[int] = []
    for t, (new, out) in enumerate([(300, 40), (57, 71), (1, 6), (128, 128), (200, 3), (90, 12)]):
        prompt = history + tokens(new, 500 + t)
        reply = turn(engine, f"t{t}", prompt, out)
        if t:
            assert reply.num_cached_tokens == len(history) - 1, t  # all but the previous last token
        assert reply.output_token_ids == cold(model, prompt, out), t
        history = prompt + reply.output_token_ids


def test_n_choices_each_leave_their_own_turn_end() -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode="full")
    prompt = tokens(35, 7)
    choices = [greedy(f"c{i}", prompt, 4) for i in range(2)]
    for c in choices:  # sampled differently: the choices' outputs differ
        c.sampling.temperature, c.sampling.seed = 1.0, 10 + int(c.request_id[1:])
    engine.generate(choices)
    assert choices[0].output_token_ids != choices[1].output_token_ids
    for c in choices:
        follow = c.all_token_ids + tokens(5, 8)
        again = turn(engine, f"{c.request_id}-next", follow, 3)
        assert again.num_cached_tokens == len(prompt) + 3
        assert again.output_token_ids == cold(model, follow, 3)


def test_an_aborted_turn_leaves_no_snapshot_of_a_half_state() -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode="full")
    request = greedy("half", tokens(40, 9), 30)
    engine.add_request(request)
    while len(request.output_token_ids) < 3:
        engine.step()
    engine.abort("half")
    follow = request.all_token_ids + tokens(5, 10)
    again = turn(engine, "next", follow, 4)
    assert again.num_cached_tokens == 32  # the last sealed boundary, not the abandoned position
    assert again.output_token_ids == cold(model, follow, 4)
    assert engine.scheduler.stats.restores["response_end"] == 0


def test_tool_call_like_turns_with_the_restore_metric() -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode="periodic", swa_checkpoint_interval=32)
    history = tokens(30, 11)
    for t in range(4):
        reply = turn(engine, f"r{t}", history, 3 + t)
        history = history + reply.output_token_ids + tokens(7, 20 + t)  # the call, then its result
    assert engine.scheduler.stats.restores["response_end"] + engine.scheduler.stats.restores["block"] == 3


# ---- the restored state itself ------------------------------------------------------------------------------
def cold_slot(model, prompt: list[int], position: int) -> list[torch.Tensor]:
    seq = SingleSequence(model, position + 1)
    seq.prefill(prompt[:position], chunk=7)
    return seq.device_kv.copy_slot(0)


class SlotAtStart:
    """Reads a request's slot when a chunk of it starts at `position` (after any restore, before compute)."""

    def __init__(self, engine, rid: str, position: int) -> None:
        self.state: list[torch.Tensor] | None = None
        real = engine.execute

        def execute(chunks):  # noqa: ANN001, ANN202
            for c in chunks:
                if c.request.request_id == rid and c.request.num_computed_tokens == position and self.state is None:
                    self.state = engine.device_kv.copy_slot(c.request.kv.slot)
            return real(chunks)

        engine.execute = execute


def live_rows(layout, name: str, position: int, ring: int) -> list[int]:
    """Rows of a ring (`ring` rows, position p at p mod ring) that the tokens from `position` on can
    still read: the window's last W−1 positions; a compressor's unfinished window (and, overlapping,
    the one before it). The rest are spent."""
    if name == "window":
        first = position - layout.window + 1
    else:
        first = position - position % layout.ratio - (layout.ratio if layout.overlap else 0)
    return sorted({p % ring for p in range(max(first, 0), position)})


def assert_same_state(engine, got: list[torch.Tensor], want: list[torch.Tensor], position: int) -> None:
    names = [(layer.layout, n) for layer in engine.device_kv.layers
             for n in ("window", "pending_kv", "pending_score", "index_pending_kv", "index_pending_score")
             if getattr(layer, n) is not None]
    assert len(got) == len(want) == len(names)
    for (layout, name), g, w in zip(names, got, want, strict=True):
        rows = live_rows(layout, name, position, g.shape[0])
        assert torch.allclose(g[rows], w[rows], rtol=1e-4, atol=1e-5), (layout.kind, name, (g - w)[rows].abs().max())


@pytest.mark.parametrize("how", ["response_end", "block", "recompute"])
def test_the_restored_slot_equals_a_cold_runs(how: str) -> None:
    model = small_model()
    mode = "zero" if how == "recompute" else "full"
    engine = engine_for(model, swa_cache_mode=mode, max_prefill_chunk=1 if how == "recompute" else 1024)
    end = {"response_end": 45, "block": 48, "recompute": 64}[how]
    first = turn(engine, "t1", tokens(end - 2, 12), 3)
    prompt = first.all_token_ids + tokens(5, 13)
    probe = SlotAtStart(engine, "t2", end)
    second = turn(engine, "t2", prompt, 2)
    assert engine.scheduler.stats.restores == {how: 1}
    assert second.num_cached_tokens == (end if how != "recompute" else end - 35)  # zero mode: 35 recomputed
    assert probe.state is not None
    assert_same_state(engine, probe.state, cold_slot(model, prompt, end), end)


def test_a_zero_mode_span_one_layer_short_is_caught_by_the_state_check(monkeypatch) -> None:
    from v4serve.cache.config import CacheConfig

    short = property(lambda self: max(self.window - 1, self.overlap_ratio) * (self.num_layers - 1))
    monkeypatch.setattr(CacheConfig, "zero_mode_span", short)
    model = small_model()
    engine = engine_for(model, swa_cache_mode="zero", max_prefill_chunk=1)
    first = turn(engine, "t1", tokens(62, 12), 3)
    prompt = first.all_token_ids + tokens(5, 13)
    probe = SlotAtStart(engine, "t2", 64)
    turn(engine, "t2", prompt, 2)
    with pytest.raises(AssertionError):
        assert_same_state(engine, probe.state, cold_slot(model, prompt, 64), 64)


# ---- after a restart: from the SSD store ----------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["full", "periodic"])
@pytest.mark.parametrize("end", [12, 45, 48, 70])  # inside the first block (parent: the root), mid-block, boundary
def test_the_next_turn_resumes_from_disk_after_a_restart(tmp_path, mode: str, end: int) -> None:
    model = small_model()
    first_engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=64, kv_store_dir=str(tmp_path))
    first = turn(first_engine, "t1", tokens(end - 3, 30 + end), 4)
    first_engine.close()  # queued files land
    assert list(tmp_path.rglob("*.resp")) or end % B == 0
    prompt = first.all_token_ids + tokens(6, 31)
    engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=64, kv_store_dir=str(tmp_path))
    second = turn(engine, "t2", prompt, 5)
    engine.close()
    assert second.num_cached_tokens == end
    assert second.num_disk_hit_tokens == end // B * B
    assert second.output_token_ids == cold(model, prompt, 5)
    assert engine.kv.store.stats_snapshot().errors == {}


def test_a_bad_response_end_file_is_a_miss(tmp_path) -> None:
    model = small_model()
    first_engine = engine_for(model, swa_cache_mode="full", kv_store_dir=str(tmp_path))
    first = turn(first_engine, "t1", tokens(40, 40), 5)
    first_engine.close()
    (path,) = tmp_path.rglob("*.resp")
    data = path.read_bytes()
    path.write_bytes(data[:-30] + bytes([data[-30] ^ 0xFF]) + data[-29:])
    prompt = first.all_token_ids + tokens(6, 41)
    engine = engine_for(model, swa_cache_mode="full", kv_store_dir=str(tmp_path))
    second = turn(engine, "t2", prompt, 5)
    engine.close()
    assert second.num_cached_tokens == 32  # the sealed boundary (a snapshot at every block in `full`)
    assert second.output_token_ids == cold(model, prompt, 5)
    assert engine.kv.store.stats_snapshot().errors["checksum"] == 1


def test_many_conversations_under_memory_pressure_keep_their_heads() -> None:
    """Eight conversations over one shared system prompt, turn after turn, in a Block Cache far too
    small for all of them: eviction takes leaves first, so no findable block ever loses the block
    it continues; integrity holds after every step; every reply is the cold one."""
    model = small_model()
    engine = engine_for(model, swa_cache_mode="periodic", swa_checkpoint_interval=32, num_blocks=20,
                        max_num_seqs=4, max_num_batched_tokens=48)
    system = tokens(40, 90)
    histories = {c: system + tokens(5 + c, 91 + c) for c in range(8)}
    pool = engine.kv.pool
    evicted_before = pool.evictions
    for t in range(5):
        requests = [greedy(f"c{c}-t{t}", histories[c], 3 + c % 3) for c in range(8)]
        for r in requests:
            engine.add_request(r)
        while engine.has_work():
            engine.step()
            engine.check()
            for block in pool.blocks:  # every findable block's parent is findable
                if block.block_hash is not None and block.parent_hash is not None:
                    assert pool.cached_block(block.parent_hash) is not None
        for c, r in zip(range(8), requests, strict=True):
            assert r.output_token_ids == cold(model, r.prompt_token_ids, len(r.output_token_ids)), (c, t)
            histories[c] = r.all_token_ids + tokens(17, 200 + 10 * t + c)
    assert pool.evictions > evicted_before  # the pressure was real
    assert pool.cached_block(engine.kv.hashes(system, None)[0]) is not None  # the shared head survived


def test_a_request_that_came_before_its_prefix_was_stored_reads_it_from_disk(tmp_path) -> None:
    """Three requests arrive at once, one slot: the first writes its document to the store, the second's
    document takes the Block Cache, the third asks about the first document. At its arrival the store
    held nothing; by its admission the document is on disk and off the device: it is read, not computed."""
    model = small_model()
    engine = engine_for(model, swa_cache_mode="full", kv_store_dir=str(tmp_path), max_num_seqs=1, num_blocks=8,
                        max_num_batched_tokens=256)
    first_doc, other_doc = tokens(6 * B + 5, 70), tokens(6 * B + 5, 71)
    first, other, again = (greedy("a", first_doc, 3), greedy("c", other_doc, 3),
                           greedy("b", first_doc[:6 * B] + tokens(9, 72), 3))
    for request in (first, other, again):
        engine.add_request(request)
    assert not engine.kv.store.contains(KIND_BLOCK, again.kv.block_hashes[0])  # nothing on disk at arrival
    while not other.status.finished:
        engine.step()
    engine.kv.store.flush()  # the first document's files written before the third request is admitted
    while engine.has_work():
        engine.step()
    engine.check()
    engine.close()
    assert again.num_disk_hit_tokens >= 5 * B
    assert again.output_token_ids == cold(model, again.prompt_token_ids, 3)
