"""Sampling parameters, checked on hand-made logits and through the engine."""

from __future__ import annotations

import math

import torch

from tests.helpers import engine_for, greedy, small_model, tokens
from v4serve.engine.model.single import SingleSequence
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
