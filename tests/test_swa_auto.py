"""`--swa-cache-mode auto` and the per-request `swa_cache_mode`: a prefix nobody has asked for twice
costs no window snapshots; its first hit recomputes the window and makes it hot, so requests through it
snapshot as `periodic` does plus the hit's own boundary, and the next hit restores there. Every hit
gives the cold run's greedy tokens (logits bitwise under batch invariance), at block edges and off by
one, across a restart through the SSD store, and between daemons writing one store in other modes."""

from __future__ import annotations

import pytest
import torch

from tests.daemon import PATIENCE
from tests.helpers import engine_for, greedy, rel_err, small_model, tokens
from tests.test_batch_invariance import invariant_model
from v4serve.cache.state_cache import HotPrefixes
from v4serve.engine.request import Request, SamplingParams

B = 16  # the small model's block
DOC = tokens(100, 61)


def cold_run(model, prompt: list[int], **config) -> tuple[list[int], torch.Tensor]:
    engine = engine_for(model, enable_prefix_caching=False, **config)
    out = engine.generate([greedy("cold", prompt)])["cold"]
    return out, torch.stack(engine.logits["cold"])


def ask(engine, rid: str, prompt: list[int], mode: str | None = None) -> Request:
    """The request, run alone; `req.restored` says how its hit restored the window (None: no hit)."""
    req = Request(rid, list(prompt), SamplingParams(max_tokens=6, ignore_eos=True), swa_cache_mode=mode)
    before = dict(engine.scheduler.stats.restores)
    engine.generate([req])
    engine.check()
    after = engine.scheduler.stats.restores
    req.restored = next((point for point in after if after[point] != before.get(point, 0)), None)
    return req


@pytest.mark.parametrize("shared", [B * 5 - 1, B * 5, B * 5 + 1, 95])
def test_a_prefix_writes_nothing_until_hit_then_snapshots_and_the_next_hit_restores_there(shared: int) -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode="auto", swa_checkpoint_interval=32)
    first = ask(engine, "first", DOC[:shared] + tokens(9, 62))
    assert engine.kv.snapshot_bytes_host == 0 and len(engine.kv.state.snapshots) == 0  # cold: as zero
    second_prompt = DOC[:shared] + tokens(9, 63)
    second = ask(engine, "second", second_prompt)
    hit = shared // B * B
    assert second.num_hit_tokens == hit and second.restored == "recompute"
    assert engine.kv.snapshot_bytes_host > 0  # hot: it snapshotted, the hit's boundary among them
    assert second.kv.block_hashes[hit // B - 1] in engine.kv.state.snapshots
    third_prompt = DOC[:shared] + tokens(9, 64)
    third = ask(engine, "third", third_prompt)
    assert (third.num_hit_tokens, third.num_cached_tokens, third.restored) == (hit, hit, "block")
    for req, prompt in ((first, DOC[:shared] + tokens(9, 62)), (second, second_prompt), (third, third_prompt)):
        out, logits = cold_run(model, prompt)
        assert req.output_token_ids == out, req.request_id
        assert rel_err(torch.stack(engine.logits[req.request_id]), logits) <= 1e-4
    stats = engine.stats()
    assert stats.write_modes == {"zero": 1, "periodic": 2} and stats.hot_prefixes == 1
    assert stats.restores == {"recompute": 1, "block": 1}


def test_hits_in_auto_are_bitwise_the_cold_run_under_batch_invariance() -> None:
    model = invariant_model("torch")
    engine = engine_for(model, swa_cache_mode="auto", swa_checkpoint_interval=32)
    prompts = [DOC[:80] + tokens(9, 70 + i) for i in range(3)]  # cold, hit (recompute), hit (block)
    reqs = [ask(engine, f"r{i}", p) for i, p in enumerate(prompts)]
    assert [r.restored for r in reqs] == [None, "recompute", "block"]
    for req, prompt in zip(reqs, prompts, strict=True):
        out, logits = cold_run(model, prompt)
        assert req.output_token_ids == out and torch.equal(torch.stack(engine.logits[req.request_id]), logits)


def test_a_request_chooses_its_own_mode() -> None:
    model = small_model()
    engine = engine_for(model, swa_cache_mode="periodic", swa_checkpoint_interval=32)
    ask(engine, "quiet", DOC, mode="zero")  # a one-off: writes nothing although the daemon is periodic
    assert engine.kv.snapshot_bytes_host == 0
    full = ask(engine, "everything", tokens(70, 65), mode="full")  # a snapshot at every sealed block
    assert all(h in engine.kv.state.snapshots for h in full.kv.block_hashes[:4])
    zero = engine_for(model, swa_cache_mode="zero")
    ask(zero, "keep", DOC, mode="periodic")  # the daemon writes nothing, this request does
    assert zero.kv.snapshot_bytes_host > 0
    hit = ask(zero, "again", DOC[:90] + tokens(9, 66))
    assert hit.restored in ("block", "snapshot")  # whoever wrote them, snapshots restore
    assert hit.output_token_ids == cold_run(model, DOC[:90] + tokens(9, 66))[0]


def test_hot_prefixes_decay_after_their_last_hit_and_stay_bounded() -> None:
    now = [0.0]
    hot = HotPrefixes(ttl=60.0, max_nodes=3, clock=lambda: now[0])
    hot.mark(b"a")
    now[0] = 59.0
    assert hot.any_hot([b"x", b"a"]) and hot.count() == 1
    hot.mark(b"a")  # hit again: hot for another hour from now
    now[0] = 100.0
    assert hot.any_hot([b"a"])
    now[0] = 119.0
    assert not hot.any_hot([b"a"]) and hot.count() == 0  # 60 s since its last hit
    for node in (b"1", b"2", b"3", b"4"):
        hot.mark(node)
    assert hot.count() == 3 and not hot.any_hot([b"1"])  # the least recently hit forgotten first


def test_hot_survives_a_restart_through_the_store_and_mixed_modes_share_it(tmp_path) -> None:
    model = small_model()
    store = {"kv_store_dir": str(tmp_path), "kv_store_read_timeout": PATIENCE}
    first = engine_for(model, swa_cache_mode="auto", swa_checkpoint_interval=32, **store)
    ask(first, "cold", DOC[:80] + tokens(9, 80))
    ask(first, "hot", DOC[:80] + tokens(9, 81))  # hit: snapshots at 80 written to disk too
    first.kv.store.flush(PATIENCE)
    assert first.stats().snapshot_bytes_disk > 0
    first.close()
    for mode in ("auto", "zero", "periodic"):  # a restarted daemon, or another one on the store in any mode
        engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=32, **store)
        prompt = DOC[:80] + tokens(9, 82)
        req = ask(engine, mode, prompt)
        assert (req.num_hit_tokens, req.num_cached_tokens, req.restored) == (80, 80, "block"), mode
        assert req.num_disk_hit_tokens == 80 and req.output_token_ids == cold_run(model, prompt)[0]
        engine.close()


def test_a_cache_control_mark_makes_a_prefix_hot_from_its_first_request() -> None:
    """Anthropic's clients mark what they will send again: under auto such a request snapshots as
    periodic at once (a conversation's second turn then restores from the first turn's end)."""
    import httpx

    from tests.daemon import daemon
    from tests.test_store_daemon import metric

    body = {"model": "v4serve-tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hello"}]}
    with daemon("--swa-cache-mode", "auto") as url:
        for marked in (False, True):  # two prompts that share nothing: neither is a hit
            block = {"type": "text", "text": f"system prompt {marked} " * 30}
            blocks = [{**block, "cache_control": {"type": "ephemeral"}}] if marked else [block]
            got = httpx.post(url + "/v1/messages", json={**body, "system": blocks}, timeout=PATIENCE)
            assert got.status_code == 200, got.text
        assert metric(url, "v4serve_swa_requests_total", mode="zero") == 1  # the unmarked one, cold
        assert metric(url, "v4serve_swa_requests_total", mode="periodic") == 1  # the marked one
