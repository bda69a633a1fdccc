"""Mixed batches through the cache equal each request's own uncached forward; block pressure
preempts or delays requests without touching blocks in use, and everything completes."""

from __future__ import annotations

import pytest
import torch

from tests.helpers import engine_for, greedy, reference, rel_err, small_model, tiny_model, tokens
from v4serve.engine.process.async_engine import AsyncEngine, _Choice
from v4serve.engine.request import RequestError


def check_against_reference(engine, requests):
    model = engine.model
    for req in requests:
        ref = reference(model, req.prompt_token_ids, req.output_token_ids)
        assert rel_err(torch.stack(engine.logits[req.request_id]), ref) <= 1e-4, req.request_id


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_mixed_batches_with_requests_joining_and_leaving(prefix_caching):
    model = small_model()
    engine = engine_for(model, max_num_seqs=4, max_num_batched_tokens=24, max_prefill_chunk=11,
                        enable_prefix_caching=prefix_caching)
    shared = tokens(40, 1)
    prompts = [tokens(37, 2), shared + tokens(5, 3), tokens(3, 4), shared + tokens(30, 5), tokens(70, 6)]
    reqs = [greedy(f"r{i}", p, n=n) for i, (p, n) in enumerate(zip(prompts, [9, 4, 14, 6, 3], strict=True))]
    arrivals = {0: reqs[:2], 3: reqs[2:4], 7: reqs[4:]}  # join mid-way while others decode
    step = 0
    mixed_steps = 0
    while step in arrivals or engine.has_work():
        for r in arrivals.get(step, []):
            engine.add_request(r)
        chunks = engine.scheduler.schedule()
        if chunks:
            kinds = {c.num_new > 1 or not c.completes for c in chunks}
            mixed_steps += len(kinds) == 2 and len(chunks) > 1
            engine.update(chunks, engine.execute(chunks))
        engine.check()
        step += 1
    assert mixed_steps > 0, "some steps must mix prefill chunks and decodes"
    assert [len(r.output_token_ids) for r in reqs] == [9, 4, 14, 6, 3]
    check_against_reference(engine, reqs)


def test_block_pressure_preempts_the_newest_and_everything_completes():
    model = small_model()  # 16-token blocks
    engine = engine_for(model, max_num_seqs=3, num_blocks=9, max_prefill_chunk=64, swa_cache_mode="full")
    reqs = [greedy(f"r{i}", tokens(40, 10 + i), n=40) for i in range(3)]  # 80 tokens = 5 blocks each
    for r in reqs:
        engine.add_request(r)
    held_by_running: dict[int, torch.Tensor] = {}
    while engine.has_work():
        engine.step()
        engine.check()
        # Blocks a running request holds keep their content from one step to the next.
        for r in engine.scheduler.running:
            for i, b in enumerate(r.kv.block_table[: r.kv.num_sealed]):
                entry = engine.device_kv.layers[1].entries[b]
                if (r.request_id, i) in held_by_running:
                    assert torch.equal(held_by_running[(r.request_id, i)], entry)
                held_by_running[(r.request_id, i)] = entry.clone()
        held_by_running = {k: v for k, v in held_by_running.items()
                           if any(r.request_id == k[0] for r in engine.scheduler.running)}
    assert engine.scheduler.stats.preemptions > 0
    assert all(len(r.output_token_ids) == 40 for r in reqs)
    for r in reqs:
        assert r.output_token_ids == engine_for(model, enable_prefix_caching=False).generate(
            [greedy("cold", r.prompt_token_ids, n=40)])["cold"]


def test_a_request_that_cannot_be_admitted_waits_and_later_completes():
    model = small_model()
    engine = engine_for(model, max_num_seqs=1, num_blocks=6)
    first, second = greedy("a", tokens(50, 20), n=20), greedy("b", tokens(30, 21), n=5)
    engine.add_request(first)
    engine.add_request(second)
    engine.step()
    assert [r.request_id for r in engine.scheduler.running] == ["a"]
    assert [r.request_id for r in engine.scheduler.waiting] == ["b"]  # no free slot yet
    engine.run_checked()
    assert len(first.output_token_ids) == 20 and len(second.output_token_ids) == 5
    check_against_reference(engine, [first, second])
    assert engine.kv.pool.num_used == 0 and engine.kv.state.slots.num_free == 1


def test_requests_larger_than_the_cache_are_rejected_up_front():
    engine = engine_for(small_model(), num_blocks=4, max_model_len=4096)
    with pytest.raises(RequestError, match="blocks"):
        engine.add_request(greedy("big", tokens(60, 30), n=10))  # 70 tokens > 4 blocks of 16
    with pytest.raises(RequestError) as err:
        engine_for(small_model(), max_model_len=64).add_request(greedy("long", tokens(60, 31), n=10))
    assert err.value.code == "context_length_exceeded"


def test_token_ids_outside_the_vocabulary_are_rejected_naming_the_first():
    engine = engine_for(small_model(), max_model_len=4096)
    vocab = engine.limits.vocab_size
    for bad, ids in [(vocab, [1, 2, vocab, vocab + 5]), (-1, [3, -1, vocab]), (vocab + 9, [vocab + 9] * 600)]:
        with pytest.raises(RequestError, match=f"token id {bad} is outside the vocabulary") as err:
            engine.add_request(greedy(f"bad{bad}", ids, n=2))
        assert err.value.param == "prompt"
    with pytest.raises(RequestError, match="token id -3 is outside"):
        engine.limits.check_token_ids(iter([0, -3]), "stop_token_ids")  # an iterator is read once
    engine.limits.check_token_ids(iter([0, vocab - 1]), "stop_token_ids")
    out = engine.generate([greedy("edges", [0, vocab - 1] * 40, n=2)])  # both ends of the vocabulary are ids
    assert len(out["edges"]) == 2


def test_abort_frees_slot_and_blocks_at_once():
    engine = engine_for(small_model(), max_num_seqs=2)
    r = greedy("a", tokens(50, 40), n=30)
    engine.add_request(r)
    engine.step()
    assert engine.kv.pool.num_used > 0 and engine.kv.state.slots.num_free == 1
    assert engine.abort("a")
    assert engine.kv.pool.num_used == 0 and engine.kv.state.slots.num_free == 2
    engine.check()
    assert not engine.has_work()


def test_a_held_request_is_not_scheduled_and_resumes_to_its_solo_tokens() -> None:
    """The front end holds a request whose client is not reading: the engine skips it (the others go
    on), has no work while only held requests remain, and once resumed it finishes with the tokens
    it makes alone."""
    model = small_model()
    want = engine_for(model).generate([greedy("a", tokens(20, 1), n=8)])["a"]
    engine = engine_for(model)
    held, other = greedy("a", tokens(20, 1), n=8), greedy("b", tokens(12, 2), n=8)
    engine.add_request(held)
    engine.add_request(other)
    engine.step()
    engine.pause("a", True)
    made, computed = list(held.output_token_ids), held.num_computed_tokens
    while not other.status.name.startswith("FINISHED"):
        engine.step()
    assert held.output_token_ids == made and held.num_computed_tokens == computed
    assert not engine.has_work()
    engine.pause("a", False)
    assert engine.has_work()
    while engine.has_work():
        engine.step()
    assert held.output_token_ids == want


def test_siblings_held_before_they_start_wait_until_resumed() -> None:
    """n > 1: a request's other choices start once its first has made its first token (they share its
    prompt through the prefix cache). Held while still waiting, they wait on: nothing is computed and
    no slot taken for them until they are resumed, and then they make their solo tokens. Driven step by step on this
    thread as the engine thread would (the loop is not started)."""
    model = small_model()
    want = engine_for(model).generate([greedy("solo", tokens(20, 1), n=4)])["solo"]
    engine = engine_for(model)
    loop = AsyncEngine(engine)
    made: dict[int, list[int]] = {0: [], 1: [], 2: []}
    choices = [_Choice(greedy(f"r-{i}", tokens(20, 1), n=4), i, lambda out: made[out.index].extend(out.token_ids))
               for i in range(3)]
    loop._add(choices)
    loop._pause(["r-1", "r-2"], True)  # not in the engine yet
    while engine.has_work():
        for out in engine.step():
            loop._emit(out)
    assert made == {0: want, 1: [], 2: []}
    assert all(c.request.num_computed_tokens == 0 for c in choices[1:])  # nothing computed for them
    assert engine.kv.state.slots.num_free == engine.config.max_num_seqs  # nor a slot taken
    loop._pause(["r-1", "r-2"], False)
    while engine.has_work():
        for out in engine.step():
            loop._emit(out)
    assert made == {0: want, 1: want, 2: want}


def test_a_grammar_compiles_off_the_engine_thread_while_other_requests_run() -> None:
    """A schema of thousands of properties compiles for seconds; compiled on the engine thread it stopped
    every running request's steps meanwhile. With the compile held (the injected fault: a compile that
    does not end until released), another request runs to its end; released, the grammar's request runs
    too; a request whose client leaves while its grammar compiles ends as aborted, never started."""
    import threading

    from tests.daemon import PATIENCE, wait_until
    from v4serve.engine.request import GrammarSpec, Request, SamplingParams
    from v4serve.server.text.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    engine = engine_for(tiny_model(), tokenizer_json=tokenizer.vocabulary_json())
    release, compiling = threading.Event(), threading.Event()
    real_check = engine.check_grammar

    def slow_check(spec: GrammarSpec) -> None:
        compiling.set()
        assert release.wait(PATIENCE)
        real_check(spec)

    engine.check_grammar = slow_check  # type: ignore[method-assign]
    loop = AsyncEngine(engine)
    loop.start()
    outputs: dict[str, list] = {"plain": [], "grammar": [], "gone": []}
    try:
        spec = GrammarSpec("json_schema", '{"type": "string"}', param="response_format")
        schema_request = Request("grammar", [65, 66], SamplingParams(max_tokens=4, temperature=0.0, grammar=spec))
        loop.enqueue([schema_request], outputs["grammar"].append)
        other_spec = GrammarSpec("json_schema", '{"type": "integer"}', param="response_format")
        gone = Request("gone", [65, 66], SamplingParams(max_tokens=4, temperature=0.0, grammar=other_spec))
        loop.enqueue([gone], outputs["gone"].append)
        assert compiling.wait(PATIENCE)
        loop.enqueue([greedy("plain", tokens(20, 3))], outputs["plain"].append)
        wait_until(lambda: outputs["plain"] and outputs["plain"][-1].finished, "the plain request to end")
        assert not outputs["grammar"] and not release.is_set()  # it ended while the compile was held
        loop.abort(["gone"])
        release.set()
        wait_until(lambda: outputs["grammar"] and outputs["grammar"][-1].finished, "the grammar's request to end")
        wait_until(lambda: outputs["gone"], "the aborted request's end")
    finally:
        release.set()
        loop.shutdown()
    assert outputs["plain"][-1].finish_reason == "length"
    assert outputs["grammar"][-1].finish_reason in ("stop", "length")
    assert [(o.finished, o.finish_reason, o.token_ids) for o in outputs["gone"]] == [(True, "abort", ())]


def test_a_closed_engine_leaves_the_process_its_threads() -> None:
    """Decode steps run on one intra-op thread; an engine built after another closed in the same
    process (benchmarks, tests) took that one thread for all it may use, so its prefills ran on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        engine = engine_for(small_model())
        engine.generate([greedy("a", tokens(20, 3))])  # its decode steps set one thread
        engine.close()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
