"""Randomised churn through the engine: shared prefixes, arrivals between steps, aborts, block
pressure (preemption and eviction), every SWA mode, with and without the SSD store. After every
step the cache passes its integrity check; every request that finishes has exactly the greedy
tokens of its own cold run."""

from __future__ import annotations

import random
from concurrent import futures

import pytest

from tests.daemon import PATIENCE
from tests.helpers import engine_for, greedy, small_model, tokens
from tests.test_mtp import mtp_model, recording, reference_drafts
from v4serve.engine.speculative import SpeculativeConfig


def settle_store_io(engine) -> None:
    """Let the SSD store's background writes land and its reads finish before the next step: the
    churn is then the seed's alone. Left racing, a busy machine's slower I/O changes which blocks are
    on disk at each lookup and how many steps wait on reads, and with them which requests the
    random draws abort (fewer finish) or preempt."""
    engine.kv.store.flush(timeout=PATIENCE)
    futures.wait(engine.scheduler.pending_loads(), timeout=PATIENCE)
    assert all(f.done() for f in engine.scheduler.pending_loads()), "a store read did not finish"


def cold_outputs(model, requests) -> dict[str, list[int]]:
    engine = engine_for(model, enable_prefix_caching=False, max_num_seqs=8)
    fresh = [greedy(r.request_id, r.prompt_token_ids, r.sampling.max_tokens) for r in requests]
    return engine.generate(fresh)


def cold_drafter(model, requests, rng: random.Random):
    """Speculative drafts from each request's cold run: right, or wrong at a random place (rejected
    there), so that kept and rejected drafts both meet preemption, eviction and aborts."""
    truth = cold_outputs(model, requests)

    def draft(request, most: int) -> list[int]:
        made = len(request.output_token_ids)
        drafts = truth[request.request_id][made:made + min(most, 3)]
        if drafts and rng.random() < 0.5:
            at = rng.randrange(len(drafts))
            drafts = drafts[:at] + [(drafts[at] + 1) % 300 + 1] + drafts[at + 1:]
        return drafts

    return draft


@pytest.mark.parametrize("mode", ["full", "periodic", "zero"])
@pytest.mark.parametrize("store", [False, True])
def test_random_churn_keeps_invariants_and_outputs(tmp_path, mode, store):
    churn(tmp_path, mode, store, drafts=False)


@pytest.mark.parametrize("mode", ["full", "periodic", "zero"])
def test_random_churn_with_speculative_drafts(tmp_path, mode):
    """The same churn with every decode step checking drafts (right, or wrong at random places)."""
    churn(tmp_path, mode, store=True, drafts=True)


def test_random_churn_with_mtp_drafting_beside(tmp_path):
    """With the MTP layer drafting at every step while the scheduler checks the cold run's drafts (kept
    and rejected passes meet preemption, eviction, aborts and store reads): the layer's drafts, a sample
    of them checked, are those of an uncached pass."""
    churn(tmp_path, "periodic", store=True, drafts=True, mtp=True)


def churn(tmp_path, mode: str, store: bool, drafts: bool, mtp: bool = False) -> None:
    rng = random.Random(f"churn-{mode}-{store}" + ("-drafts" if drafts else ""))  # str seeds are stable across runs
    model = mtp_model() if mtp else small_model()  # 16-token blocks, window 8 (the same main weights)
    bases = [tokens(rng.randint(20, 90), 100 + i) for i in range(4)]
    # Reads past the read timeout would be misses: none is, however slow the machine.
    extra = {"kv_store_dir": str(tmp_path), "kv_store_read_timeout": PATIENCE} if store else {}
    if mtp:
        extra["speculative"] = SpeculativeConfig("mtp", 2)
    engine = engine_for(model, swa_cache_mode=mode, swa_checkpoint_interval=32, max_num_seqs=3, num_blocks=10,
                        max_num_batched_tokens=40, max_prefill_chunk=24, **extra)
    made = recording(engine) if mtp else []
    pending = []
    for i in range(18):
        base = rng.choice(bases)
        prompt = base[: rng.randint(1, len(base))] + tokens(rng.randint(1, 20), 200 + i)
        pending.append(greedy(f"r{i}", prompt, n=rng.randint(1, 30)))
    if drafts:
        engine.scheduler.drafter = cold_drafter(model, pending, rng)
    submitted, aborted, steps = [], set(), 0
    while pending or engine.has_work():
        if pending and rng.random() < 0.5:
            req = pending.pop(0)
            engine.add_request(req)
            submitted.append(req)
        if submitted and rng.random() < 0.05:
            victim = rng.choice(submitted)
            if engine.abort(victim.request_id):
                aborted.add(victim.request_id)
        engine.step()
        engine.check()
        if store:
            settle_store_io(engine)
        steps += 1
        assert steps < 5000, "the engine stopped making progress"
    engine.close()
    finished = [r for r in submitted if r.request_id not in aborted]
    assert len(finished) >= 12
    assert all(len(r.output_token_ids) == r.sampling.max_tokens for r in finished)
    expected = cold_outputs(model, finished)
    for r in finished:
        assert r.output_token_ids == expected[r.request_id], r.request_id
    assert engine.kv.pool.num_used == 0 and engine.kv.state.slots.num_free == 3
    stats = engine.scheduler.stats
    assert stats.prefix_hits + stats.prefix_hits_disk > 0 and stats.preemptions > 0
    if drafts:
        assert 0 < engine.spec.accepted_tokens < engine.spec.draft_tokens
    for context, guesses in rng.sample(made, min(5, len(made))):
        assert guesses == reference_drafts(model, context, 2), f"after {len(context)} tokens"
    assert not mtp or len(made) > 50
