"""Sampling parameters, checked on hand-made logits and through the engine."""

from __future__ import annotations

import math

import pytest
import torch

from tests.helpers import engine_for, greedy, small_model, tokens
from v4serve.engine.model.parallel.single import SingleSequence
from v4serve.engine.request import Request, SamplingParams
from v4serve.engine.sampler import Sampler, apply_penalties, filter_logits


def req(**params) -> Request:
    return Request("r", [1, 2, 3], SamplingParams(**params))


def test_filters_keep_exactly_the_allowed_tokens():
    logits = torch.log(torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05]))
    allowed = lambda f: (f > float("-inf")).nonzero().flatten().tolist()  # noqa: E731
    assert allowed(filter_logits(logits, SamplingParams(temperature=1.0, top_k=2))) == [0, 1]
    assert allowed(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.7))) == [0, 1]
    assert allowed(filter_logits(logits, SamplingParams(temperature=1.0, top_p=0.71))) == [0, 1, 2]
    assert allowed(filter_logits(logits, SamplingParams(temperature=1.0, min_p=0.35))) == [0, 1]
    scaled = filter_logits(logits, SamplingParams(temperature=0.5))
    assert torch.allclose(scaled, logits / 0.5)


def test_penalties():
    logits = torch.tensor([2.0, -2.0, 1.0, 0.5])
    apply_penalties(logits, SamplingParams(repetition_penalty=2.0), prompt=[0], output=[1])
    assert logits.tolist() == [1.0, -4.0, 1.0, 0.5]
    logits = torch.zeros(4)
    apply_penalties(logits, SamplingParams(presence_penalty=0.5, frequency_penalty=0.25), prompt=[3], output=[2, 2, 1])
    assert logits.tolist() == [0.0, -0.75, -1.0, 0.0]  # the prompt token is not penalised


def test_greedy_logit_bias_and_logprobs():
    sampler = Sampler()
    logits = torch.tensor([1.0, 3.0, 2.0, 0.0])
    s = sampler.sample(req(logprobs=2), logits)
    assert s.token == 1
    assert math.isclose(s.logprob, float(logits.log_softmax(-1)[1]), rel_tol=1e-6)
    assert [t for t, _ in s.top] == [1, 2]
    assert sampler.sample(req(logit_bias={3: 10.0}), logits).token == 3


def test_same_seed_same_draws_regardless_of_other_requests():
    logits = torch.zeros(50)
    a, b = Sampler(seed=1), Sampler(seed=2)  # different global generators
    draws_a = [a.sample(req(temperature=1.0, seed=7), logits).token for _ in range(20)]
    for _ in range(5):
        b.sample(req(temperature=1.0), logits)  # unrelated traffic first
    draws_b = [b.sample(req(temperature=1.0, seed=7), logits).token for _ in range(20)]
    draws_c = [Sampler().sample(req(temperature=1.0, seed=8), logits).token for _ in range(20)]
    assert draws_a == draws_b
    assert draws_a != draws_c


def test_engine_stop_token_ids_ignore_eos_and_length():
    model = small_model()
    prompt = tokens(30, 1)
    free = engine_for(model).generate([greedy("a", prompt, n=12)])["a"]
    stop_at = free[4]
    r = Request("b", prompt, SamplingParams(max_tokens=12, stop_token_ids=[stop_at]))
    out = engine_for(model).generate([r])["b"]
    assert out == free[: free.index(stop_at) + 1] and r.finish_reason == "stop"
    eos = Request("c", prompt, SamplingParams(max_tokens=12))
    engine = engine_for(model)
    engine.eos_token_id = free[2]  # make the model's third greedy token the EOS
    assert engine.generate([eos])["c"] == free[: free.index(free[2]) + 1] and eos.finish_reason == "stop"
    ignored = Request("d", prompt, SamplingParams(max_tokens=12, ignore_eos=True))
    engine.generate([ignored])
    assert ignored.output_token_ids == free and ignored.finish_reason == "length"


def test_prompt_logprobs_match_the_reference_forward():
    model = small_model()
    prompt = tokens(40, 2)
    r = Request("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3))
    engine = engine_for(model, max_prefill_chunk=13)  # several chunks
    engine.generate([greedy("warm", prompt)])  # a cached prefix must not skip prompt rows
    engine.generate([r])
    assert r.num_cached_tokens == 0
    rows = SingleSequence(model, len(prompt)).prefill(prompt).log_softmax(-1)
    assert r.prompt_logprobs[0] is None
    assert len(r.prompt_logprobs) == len(prompt)
    for p in range(1, len(prompt)):
        entry = r.prompt_logprobs[p]
        assert entry.token == prompt[p]
        assert math.isclose(entry.logprob, float(rows[p - 1, prompt[p]]), rel_tol=1e-4, abs_tol=1e-5)
        assert [t for t, _ in entry.top] == rows[p - 1].topk(3).indices.tolist()


# ---- the step's rows sampled together, on the device ---------------------------------------------------
VOCAB = 70


def reference_row(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int],
                  eos: int | None) -> tuple[int, float, list[tuple[int, float]]]:
    """One greedy row the plain way: bias, min_tokens, penalties, then argmax and log_softmax."""
    logits = logits.clone()
    for t, b in params.logit_bias.items():
        logits[t] += b
    if len(output) < params.min_tokens:
        logits[[*params.stop_token_ids, *([eos] if eos is not None else [])]] = float("-inf")
    if params.repetition_penalty != 1.0:
        for t in set(prompt) | set(output):
            v = logits[t]
            logits[t] = v / params.repetition_penalty if v > 0 else v * params.repetition_penalty
    for t in set(output):
        n = output.count(t)
        logits[t] -= params.frequency_penalty * n + params.presence_penalty
    logprobs = logits.log_softmax(-1)
    token = int(logits.argmax())
    k = params.logprobs or 0
    vals, ids = logprobs.topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
    return token, float(logprobs[token]), list(zip(ids.tolist(), vals.tolist(), strict=True))


def mixed_requests() -> list[Request]:
    kinds = [SamplingParams(), SamplingParams(logprobs=3), SamplingParams(logit_bias={5: 30.0}),
             SamplingParams(min_tokens=4, stop_token_ids=[7]), SamplingParams(repetition_penalty=1.7, logprobs=2),
             SamplingParams(presence_penalty=0.6, frequency_penalty=0.3),
             SamplingParams(temperature=0.8, top_k=5, seed=11, logprobs=1),
             SamplingParams(temperature=1.2, top_p=0.6, min_p=0.05, seed=12), SamplingParams(temperature=1.0, seed=13)]
    gen = torch.Generator().manual_seed(5)
    requests = []
    for i, params in enumerate(kinds):
        prompt = torch.randint(0, VOCAB, (12,), generator=gen).tolist()
        r = Request(f"r{i}", prompt, params)
        r.output_token_ids = torch.randint(0, VOCAB, (i % 3,), generator=gen).tolist()
        requests.append(r)
    return requests


def test_a_batch_samples_each_row_as_it_would_alone_and_as_the_plain_way():
    requests = mixed_requests()
    logits = torch.randn(len(requests), VOCAB, generator=torch.Generator().manual_seed(6)) * 3
    logits[3, 7] = logits[3, 1] = 50.0  # the stop token and EOS lead: min_tokens must bar them
    together = Sampler(eos_token_id=1).sample_rows(requests, logits)
    for i, (request, got) in enumerate(zip(requests, together, strict=True)):
        alone = Sampler(seed=99, eos_token_id=1).sample(request, logits[i])  # its own generator when seeded
        assert got == alone, i
        if request.sampling.greedy:
            token, logprob, top = reference_row(logits[i], request.sampling, request.prompt_token_ids,
                                                request.output_token_ids, eos=1)
            assert got.token == token and math.isclose(got.logprob, logprob, rel_tol=1e-6, abs_tol=1e-6), i
            assert [t for t, _ in got.top] == [t for t, _ in top], i
    assert together[2].token == 5 and together[3].token not in (7, 1)


def test_top_p_applies_to_what_top_k_kept():
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1]))
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=2, top_p=0.5))
    assert (kept > float("-inf")).tolist() == [True, False, False, False]  # 0.4 of 0.7 reaches 0.5
    kept = filter_logits(logits, SamplingParams(temperature=1.0, top_k=3, top_p=1.0))
    assert (kept > float("-inf")).tolist() == [True, True, True, False]


def test_draws_follow_the_filtered_distribution():
    """4,000 rows in one batch on the shared generator, and 4,000 steps of one seeded request: each
    token's share within 5 standard deviations of its probability (fixed seeds: never flaky)."""
    probs = torch.tensor([0.5, 0.25, 0.15, 0.07, 0.03])
    params = SamplingParams(temperature=1.0, top_k=4)
    want = probs[:4] / probs[:4].sum()
    n = 4000
    batch = Sampler(seed=3).sample_rows([req(**vars(params)) for _ in range(n)], probs.log().expand(n, -1))
    sampler, seeded = Sampler(), req(temperature=1.0, top_k=4, seed=21)
    steps = [sampler.sample(seeded, probs.log()).token for _ in range(n)]
    for drawn in ([s.token for s in batch], steps):
        counts = torch.bincount(torch.tensor(drawn), minlength=5).double() / n
        assert counts[4] == 0  # outside top-k
        sigma = (want * (1 - want) / n).sqrt()
        assert ((counts[:4] - want).abs() <= 5 * sigma).all(), counts


def test_the_grammar_mask_on_the_device_is_llguidances():
    import llguidance.numpy as llg_np
    import numpy as np

    from v4serve.engine.sampler import _mask_grammar

    rng = np.random.default_rng(0)
    words = rng.integers(-(2**31), 2**31, size=(3, 3), dtype=np.int64).astype(np.int32)
    words[0, 2] = -(2**31)  # bit 31 alone
    logits = torch.randn(3, 100)  # past the mask's 96 tokens: barred, as llguidance bars them
    want = logits.numpy().copy()
    llg_np.apply_token_bitmask_inplace(want, words)
    got = logits.clone()
    _mask_grammar(got, torch.arange(3), torch.from_numpy(words))
    assert torch.equal(got, torch.from_numpy(want))


def test_sampling_never_reads_the_device_back(monkeypatch):
    """On the `meta` device (a stand-in for a GPU: every value lives there), the step's sampling of
    greedy, biased, penalised, grammar-masked and drawn rows with logprobs: no read back, no blocking
    copy; what goes up is parameters and indices, non-blocking; the result is one tensor."""
    from v4serve.engine.sampler import _RowPrep
    from v4serve.kernels.launches import HostSyncs

    sampler = Sampler(eos_token_id=1)
    monkeypatch.setattr(sampler, "_generator", lambda *_: None)  # the meta device has no generators
    mask = torch.full((3,), -1, dtype=torch.int32).numpy()
    preps = [_RowPrep.of(r, r.sampling, r.prompt_token_ids, r.output_token_ids, 1, mask if i == 0 else None)
             for i, r in enumerate(mixed_requests())]
    logits = torch.empty(len(preps), VOCAB, device="meta", dtype=torch.bfloat16)
    with HostSyncs() as syncs:
        result = sampler.on_device(preps, logits)
    assert syncs.found == []
    assert syncs.transfers > 0  # the uploads happened (and were non-blocking, else found)
    assert result.device.type == "meta" and result.shape == (len(preps), 3 + 2 * 3)


def test_a_spent_thinking_budget_forces_the_end_of_thinking_and_nothing_else() -> None:
    """Budget 3, end token 7: the fourth token is 7 (whatever the logits), the others are the unbudgeted
    run's until then; a thinking that ended before its budget is not touched; others in the batch neither."""
    model, prompt = small_model(), tokens(10, 1)

    def run(*params: SamplingParams) -> list[list[int]]:
        out = engine_for(model).generate([Request(f"r{i}", list(prompt), p) for i, p in enumerate(params)])
        return [out[f"r{i}"] for i in range(len(params))]

    free = SamplingParams(max_tokens=8, ignore_eos=True)
    budgeted = SamplingParams(max_tokens=8, ignore_eos=True, thinking_budget=3, thinking_end_token=7)
    (plain,) = run(free)
    got, beside = run(budgeted, free)
    assert 7 not in plain[:4] and got[:4] == [*plain[:3], 7] and beside == plain
    early = {7: 100.0, plain[0]: -100.0}  # the thinking ends at once
    assert run(SamplingParams(**{**vars(budgeted), "logit_bias": early}))[0] == \
        run(SamplingParams(**{**vars(free), "logit_bias": early}))[0]


# ---- logprobs under masks ---------------------------------------------------------------------------------------
def run_collecting_samples(engine, requests: list[Request]) -> dict[str, list]:
    """Step `requests` to completion → each one's samples (what the front end turns into logprobs)."""
    samples: dict[str, list] = {r.request_id: [] for r in requests}
    for r in requests:
        engine.add_request(r)
    while engine.has_work():
        for out in engine.step():
            assert out.error is None, out.error
            samples[out.request_id].extend(out.samples)
    return samples


def allowed_tokens(bitmask) -> set[int]:
    import numpy as np

    bits = np.unpackbits(bitmask.view(np.uint8), bitorder="little")
    return set(np.flatnonzero(bits).tolist())


def test_logprobs_under_a_json_schema_grammar_are_finite_and_only_of_allowed_tokens():
    """A grammar bars most of the vocabulary (−inf): the alternatives it bars are not listed (fewer than
    asked may come back), the chosen token's logprob is finite, and what is listed is what the grammar
    allows at that step, greedy and drawn alike. The unmasked run still lists as many as asked."""
    import json

    from v4serve.engine.request import GrammarSpec
    from v4serve.server.text.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}, "n": {"type": "integer", "minimum": 0,
                                                                               "maximum": 9}},
              "required": ["ok", "n"], "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema), "response_format")
    engine = engine_for(small_model(), tokenizer_json=tokenizer.vocabulary_json())
    prompt = tokens(12, 3)
    requests = [Request("greedy", list(prompt), SamplingParams(max_tokens=40, logprobs=2, grammar=spec)),
                Request("drawn", list(prompt), SamplingParams(max_tokens=40, logprobs=5, temperature=1.0, seed=4,
                                                              grammar=spec)),
                Request("free", list(prompt), SamplingParams(max_tokens=4, logprobs=3, ignore_eos=True))]
    samples = run_collecting_samples(engine, requests)
    for r in requests[:2]:
        assert r.finish_reason == "stop"
        json.loads(tokenizer.decode(r.output_token_ids))  # the grammar held (and ended the request)
        check = engine.grammar_matcher(spec)
        assert len(samples[r.request_id]) == len(r.output_token_ids)
        fewer = 0
        for s in samples[r.request_id]:
            allowed = allowed_tokens(check.allowed_bitmask())
            assert s.token in allowed and math.isfinite(s.logprob)
            assert all(math.isfinite(lp) for _, lp in s.top), s.top
            assert {t for t, _ in s.top} <= allowed, (s.top, allowed)
            assert len(s.top) == min(r.sampling.logprobs, len(allowed))
            fewer += len(s.top) < r.sampling.logprobs
            check.accept(s.token)
        assert fewer > 0  # some steps allowed fewer tokens than were asked for
    assert all(len(s.top) == 3 and all(math.isfinite(lp) for _, lp in s.top) for s in samples["free"])


def test_a_row_with_every_token_barred_fails_alone_without_non_finite_logprobs():
    """logit_bias −inf on the one token a spent thinking budget allows: nothing can be drawn, so that
    request fails (no NaN logprob is made up for it) and the others in the batch go on."""
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    barred = req(logprobs=2, thinking_budget=0, thinking_end_token=7, logit_bias={7: float("-inf")})
    fine = req(logprobs=2, logit_bias={3: float("-inf")})
    bad, good = Sampler().sample_rows([barred, fine], logits)
    assert isinstance(bad, ValueError) and "barred" in str(bad)
    assert math.isfinite(good.logprob) and len(good.top) == 2 and all(math.isfinite(lp) for _, lp in good.top)
    single = Sampler().sample(req(logprobs=VOCAB, logit_bias={3: float("-inf"), 9: float("-inf")}), logits[0])
    assert len(single.top) == VOCAB - 2 and {3, 9}.isdisjoint(t for t, _ in single.top)


def test_prompt_logprobs_list_no_non_finite_alternative_and_refuse_a_non_finite_one():
    """Prompt logprobs come from the raw logits: a −inf there (a broken model) is not listed as an
    alternative, and a prompt token whose own logprob is not finite fails the request, not the reply."""
    import pytest

    from v4serve.engine.sampler import NonFiniteLogits

    engine = engine_for(small_model())
    rows = torch.zeros(2, VOCAB)
    rows[:, 5:] = float("-inf")  # five tokens left; prompt token 3 among them
    r = Request("p", [1, 3, 9], SamplingParams(prompt_logprobs=8))
    engine._record_prompt_logprobs(r, 0, rows[:1])
    entry = r.prompt_logprobs[1]
    assert entry.token == 3 and math.isclose(entry.logprob, -math.log(5), rel_tol=1e-6)
    assert sorted(t for t, _ in entry.top) == [0, 1, 2, 3, 4]
    with pytest.raises(NonFiniteLogits):  # prompt token 9 is −inf
        engine._record_prompt_logprobs(r, 1, rows[1:])


# ---- seeded choices ------------------------------------------------------------------------------------------------
def seeded_choices(seeds: range, n: int, max_tokens: int = 8) -> dict[tuple[int, int], list[int]]:
    """Each (seed, choice index)'s tokens, as the front end asks for n choices: the client's seed on
    every choice, its index beside it; drawn at temperature 1 on one engine."""
    prompt = tokens(10, 4)
    requests = {(s, j): Request(f"s{s}-c{j}", list(prompt), SamplingParams(
        max_tokens=max_tokens, temperature=1.0, seed=s, choice_index=j, ignore_eos=True))
        for s in seeds for j in range(n)}
    engine_for(small_model(), max_num_seqs=16).generate(list(requests.values()))
    return {key: r.output_token_ids for key, r in requests.items()}


def test_seeded_choices_draw_independent_streams_and_choice_zero_is_the_seed_alone():
    """n = 16 over seeds 5..8: the 64 outputs differ (with seed + index, seed s's choice j was seed
    s + 1's choice j − 1); choice 0 is the n = 1 request with that seed; the same seeds again give the
    same outputs."""
    got = seeded_choices(range(5, 9), 16)
    assert len({tuple(t) for t in got.values()}) == len(got) == 64
    for s in range(5, 8):
        for j in range(1, 16):
            assert got[s, j] != got[s + 1, j - 1], (s, j)
    alone = Request("alone", tokens(10, 4), SamplingParams(max_tokens=8, temperature=1.0, seed=6, ignore_eos=True))
    assert engine_for(small_model()).generate([alone])["alone"] == got[6, 0]
    assert seeded_choices(range(5, 9), 16) == got


def test_choice_seeds_are_checked_and_choice_zero_keeps_the_seed():
    import pytest

    from v4serve.engine.request import MAX_SEED, RequestError, choice_seed

    assert choice_seed(MAX_SEED, 0) == MAX_SEED and choice_seed(5, 0) == 5
    derived = {choice_seed(s, j) for s in range(50) for j in range(1, 17)}
    assert len(derived) == 50 * 16 and all(0 <= d <= MAX_SEED for d in derived)
    assert derived.isdisjoint(range(100))  # never another small client seed
    engine = engine_for(small_model())
    engine.add_request(Request("top", [1, 2], SamplingParams(seed=MAX_SEED, choice_index=15, temperature=1.0)))
    for bad, param in (({"seed": MAX_SEED + 1}, "seed"), ({"seed": -1}, "seed"), ({"choice_index": -1}, "n")):
        with pytest.raises(RequestError) as err:
            engine.add_request(Request("bad", [1, 2], SamplingParams(**bad)))
        assert err.value.param == param
        if param == "seed":  # the seed is checked as the client sent it: no index is added to it any more
            assert "choice index" not in str(err.value)


# ---- penalty counts kept on the device ----------------------------------------------------------------------
def test_penalty_counts_are_filled_once_then_take_only_new_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    from v4serve.engine import penalties
    from v4serve.engine.penalties import PenaltyCounts

    table = PenaltyCounts(VOCAB, torch.device("cpu"))
    prompt, output = [3, 3, 9], [4]
    (row,) = table.rows([("a", prompt, output)])
    assert table.seen[row].nonzero().flatten().tolist() == [3, 4, 9]
    assert table.counts[row].nonzero().flatten().tolist() == [4]
    output += [4, 5]
    uploads = []
    real = penalties.upload
    monkeypatch.setattr(penalties, "upload", lambda values, *a: uploads.append(len(values)) or real(values, *a))
    assert table.rows([("a", prompt, output)]) == [row]
    assert uploads == [4, 4]  # rows and tokens of the two new tokens, for each tensor: not the prompt again
    assert table.counts[row][[4, 5]].tolist() == [2.0, 1.0] and table.seen[row].sum() == 4
    table.forget("a")
    (again,) = table.rows([("b", [7], [])])  # the freed row, cleared
    assert again == row and table.seen[row].nonzero().flatten().tolist() == [7] and table.counts[row].sum() == 0


def test_penalty_counts_grow_and_a_repeated_key_takes_one_row() -> None:
    from v4serve.engine.penalties import PenaltyCounts

    table = PenaltyCounts(VOCAB, torch.device("cpu"))
    rows = table.rows([(f"r{i}", [i], [i + 1]) for i in range(9)] + [("r0", [0], [1])])
    assert sorted(set(rows[:9])) == list(range(9)) and rows[9] == rows[0]
    assert table.seen.shape[0] >= 9 and all(table.seen[rows[i]].nonzero().flatten().tolist() == [i, i + 1]
                                            for i in range(9))
    for i in range(9):
        table.forget(f"r{i}")
    assert table.seen.shape == table.counts.shape == (0, VOCAB)  # nobody penalised: the memory goes back
    assert table.rows([("s", [2], [])]) == [0]


def test_penalised_rows_over_many_steps_equal_counts_made_from_scratch_each_step() -> None:
    """A sampler keeps its penalty counts between steps (only new tokens go up); a fresh sampler at each
    step counts the whole context: the same tokens and logprobs, bitwise, with drafts before rows and a
    finished request's row taken by a new one on the way."""
    gen = torch.Generator().manual_seed(8)
    kinds = [SamplingParams(repetition_penalty=1.3, logprobs=2), SamplingParams(frequency_penalty=0.4),
             SamplingParams(presence_penalty=0.7, repetition_penalty=0.8), SamplingParams(),
             SamplingParams(frequency_penalty=0.2, presence_penalty=0.1, logprobs=1)]
    requests = [Request(f"r{i}", torch.randint(0, VOCAB, (30,), generator=gen).tolist(), p)
                for i, p in enumerate(kinds)]
    kept, penalised = Sampler(eos_token_id=1), 0
    for step in range(40):
        logits = torch.randn(len(requests), VOCAB, generator=gen) * 2
        drafted = [torch.randint(0, VOCAB, (step % 3,), generator=gen).tolist() for _ in requests]
        got = kept.sample_rows(requests, logits, drafted)
        assert got == Sampler(eos_token_id=1).sample_rows(requests, logits, drafted), step
        for request, sample, row in zip(requests, got, logits, strict=True):
            request.output_token_ids.append(sample.token)
            penalised += sample.token != int(row.argmax())
        if step == 20:  # one finishes; a new one takes its row
            kept.forget(requests[1].request_id)
            requests[1] = Request("new", torch.randint(0, VOCAB, (50,), generator=gen).tolist(), kinds[1])
    assert penalised > 10  # the penalties changed what was picked


def test_a_rows_preparation_is_kept_only_while_it_cannot_change() -> None:
    """A request's row preparation is made once when nothing in it depends on the output so far; one that
    does (min_tokens still to reach, a thinking budget) is made again every step, and a request id used
    again with other parameters never gets the old one."""
    sampler = Sampler(eos_token_id=1)
    logits = torch.tensor([0.0, 5.0, 1.0, 0.5])  # EOS (1) wins whenever it is allowed
    plain = req()
    assert sampler.prepare(plain) is sampler.prepare(plain)
    early = Request("early", [5, 6], SamplingParams(min_tokens=3))
    made = []
    for _ in range(5):
        sample = sampler.sample_rows([early], logits[None])[0]
        made.append(sample.token)
        early.output_token_ids.append(sample.token)
    assert made == [2, 2, 2, 1, 1]  # EOS barred for the first three, then the kept preparation allows it
    budget = Request("think", [5], SamplingParams(thinking_budget=2, thinking_end_token=3))
    first = sampler.prepare(budget)
    budget.output_token_ids += [2, 2]
    assert sampler.prepare(budget) is not first and sampler.prepare(budget).bitmask is not None
    again = Request(plain.request_id, [5], SamplingParams(logit_bias={3: 10.0}))  # not forgotten: an id reused
    assert sampler.sample_rows([again], logits[None])[0].token == 3
