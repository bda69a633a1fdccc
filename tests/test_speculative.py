"""Speculative decoding (n-gram drafts and injected drafters): exact and cache-correct.

Greedy output and every emitted token's logits are bitwise those of the run without speculation
(batch-invariant kernels, torch backend) whatever the drafts: always right, wrong at a given place,
or n-gram drafts; in every SWA mode, across block edges (16 tokens here) and window edges (8), beside
a request that drafts nothing, with stop tokens and max_tokens inside a draft's reach; the cache passes
its integrity check after every step, and a later request that hits blocks sealed by a drafted one
gets its cold run's logits. Seeded sampling is reproducible; the verifier keeps the model's
distribution (a chi-square test on a small vocabulary, which a biased verifier fails)."""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable

import pytest
import torch

from tests.helpers import engine_for, small_model, tokens
from v4serve.engine.engine import LLMEngine
from v4serve.engine.request import Request, SamplingParams
from v4serve.engine.sampler import Sampler
from v4serve.engine.speculative import SpecCounters, SpeculativeConfig, accepted_count, ngram_drafts
from v4serve.kernels.registry import load_kernels

MODES = ["full", "periodic", "zero"]
NGRAM = SpeculativeConfig("ngram", 3, 1, 4)
BASE = tokens(37, 5)
# Copy-heavy: the reply's n-gram drafts come from here. 118 tokens: the first output crosses block 7's edge.
PROMPTS = {"copy": BASE * 3 + BASE[:7], "other": tokens(21, 6)}
OUTPUT = 24


@functools.cache
def invariant_model():
    model = small_model()
    model.use_kernels(load_kernels("torch", "cpu", batch_invariant=True))
    return model


def request(rid: str, prompt: list[int], n: int = OUTPUT, **sampling) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=n, ignore_eos=True, **sampling))


def run(requests: list[Request], drafter: Callable[[LLMEngine], Callable] | None = None,
        spec: SpeculativeConfig | None = None, engine: LLMEngine | None = None, **config):
    """Outputs and each emitted token's logits, every step checked for cache integrity."""
    engine = engine or engine_for(invariant_model(), speculative=spec, **config)
    if drafter is not None:
        engine.scheduler.drafter = drafter(engine)
    for r in requests:
        engine.add_request(r)
    engine.run_checked()
    assert all(r.status.name.startswith("FINISHED") for r in requests)
    return ({r.request_id: list(r.output_token_ids) for r in requests},
            {r.request_id: torch.stack(engine.logits[r.request_id]) for r in requests}, engine)


@functools.cache
def cold(mode: str) -> tuple[dict, dict]:
    outputs, logits, _ = run([request(rid, p) for rid, p in PROMPTS.items()], swa_cache_mode=mode)
    return outputs, logits


def oracle(truth: dict[str, list[int]], wrong_at: int | None) -> Callable[[LLMEngine], Callable]:
    """Drafts from the run without speculation: right, or wrong at draft `wrong_at` (rejected there);
    the request `other` gets none (a request that does not speculate shares the steps), nor do others."""

    def drafter(_: LLMEngine) -> Callable:
        def draft(req: Request, most: int) -> list[int]:
            if req.request_id == "other" or req.request_id not in truth:
                return []
            made = len(req.output_token_ids)
            drafts = list(truth[req.request_id][made:made + 3])[:most]
            if wrong_at is not None and wrong_at < len(drafts):
                drafts[wrong_at] = (drafts[wrong_at] + 1) % 300 + 1
            return drafts

        return draft

    return drafter


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("drafts", ["always right", "wrong at the first", "wrong at the third", "n-gram"])
def test_greedy_tokens_and_logits_are_bitwise_the_run_without_drafts(mode: str, drafts: str) -> None:
    truth, want = cold(mode)
    requests = [request(rid, p) for rid, p in PROMPTS.items()]
    if drafts == "n-gram":
        outputs, logits, engine = run(requests, spec=NGRAM, swa_cache_mode=mode)
    else:
        wrong = {"always right": None, "wrong at the first": 0, "wrong at the third": 2}[drafts]
        outputs, logits, engine = run(requests, oracle(truth, wrong), spec=NGRAM, swa_cache_mode=mode)
    assert outputs == truth
    for rid in PROMPTS:
        assert torch.equal(logits[rid], want[rid]), rid
    spec = engine.spec
    assert spec.drafts > 0
    if drafts == "always right":
        assert spec.accepted_tokens == spec.draft_tokens
    elif drafts == "wrong at the first":
        assert spec.accepted_tokens == 0
    else:
        assert 0 < spec.accepted_tokens < spec.draft_tokens or drafts == "n-gram"


@pytest.mark.parametrize("mode", MODES)
def test_a_later_request_hitting_blocks_a_drafted_one_sealed_gets_its_cold_logits(mode: str) -> None:
    truth, _ = cold(mode)
    _, _, engine = run([request("copy", PROMPTS["copy"])], oracle(truth, 1), spec=NGRAM, swa_cache_mode=mode)
    follow = PROMPTS["copy"] + truth["copy"][:30] + tokens(5, 9)  # its prompt, 30 of its tokens, new text
    hit_out, hit_logits, _ = run([request("next", follow, 12)], engine=engine)
    cold_out, cold_logits, _ = run([request("next", follow, 12)], swa_cache_mode=mode)
    assert engine.scheduler.stats.prefix_hits > 0
    assert hit_out == cold_out and torch.equal(hit_logits["next"], cold_logits["next"])


def test_stop_tokens_and_max_tokens_within_a_drafts_reach_end_it_as_without_drafts() -> None:
    truth, _ = cold("periodic")
    stop = truth["copy"][9]
    for cut in (5, 6, 7):  # max_tokens at, one before and one after a draft's last place
        plain, _, _ = run([request("copy", PROMPTS["copy"], cut, stop_token_ids=[stop])])
        drafted, _, engine = run([request("copy", PROMPTS["copy"], cut, stop_token_ids=[stop])],
                                 oracle(truth, None), spec=NGRAM)
        assert drafted == plain and len(drafted["copy"]) == cut
    plain, _, _ = run([request("copy", PROMPTS["copy"], 20, stop_token_ids=[stop])])
    drafted, _, _ = run([request("copy", PROMPTS["copy"], 20, stop_token_ids=[stop])], oracle(truth, None), spec=NGRAM)
    assert drafted == plain and drafted["copy"][-1] == stop and len(drafted["copy"]) <= 10


def test_seeded_sampling_with_drafts_is_reproducible() -> None:
    def sampled() -> list[int]:
        req = request("s", PROMPTS["copy"], 30, temperature=1.0, seed=7)
        truth, _ = cold("periodic")
        outputs, _, _ = run([req], oracle(truth, 1), spec=NGRAM)
        return outputs["s"]

    assert sampled() == sampled()


# ---- the verifier keeps the model's distribution ----------------------------------------------------------------
VOCAB = 6
ROW0 = torch.tensor([0.5, 1.5, -0.3, 1.0, 0.0, -1.0])  # the row after the request's last token
ROW1 = torch.tensor([1.2, -0.5, 0.7, 0.1, 0.9, -2.0])  # the row after the draft
DRAFT = 3
DRAWS = 6000


def chi_square(counts: list[int], probs: torch.Tensor) -> float:
    total = sum(counts)
    return sum((c - total * p) ** 2 / (total * p) for c, p in zip(counts, probs.tolist(), strict=True))


# The 0.999 quantile of chi-square with 5 degrees of freedom: a right verifier fails 1 time in 1,000
# per draw of the fixed seeds below, which pass; a biased one fails by far.
CHI2_5_999 = 20.52


def verified(sampler: Sampler, biased: bool) -> tuple[list[int], list[int]]:
    """Over DRAWS passes with one draft: how often each token came first, and which came second when
    the draft was kept (the second is then the last row's sample)."""
    first, second = [0] * VOCAB, [0] * VOCAB
    req = Request("v", [1], SamplingParams(max_tokens=8, temperature=1.0))
    logits = torch.stack([ROW0, ROW1])
    for _ in range(DRAWS):
        s0, s1 = sampler.sample_rows([req, req], logits, [(), (DRAFT,)])
        kept = accepted_count([DRAFT], [s0.token])
        if biased and kept == 0 and ROW0.softmax(0)[DRAFT] > 0.2:
            kept = 1  # a verifier that keeps a likely draft it should have rejected
        emitted = [DRAFT, s1.token] if kept else [s0.token]
        first[emitted[0]] += 1
        if kept:
            second[emitted[1]] += 1
    return first, second


def test_tokens_verified_with_drafts_follow_the_models_distribution() -> None:
    first, second = verified(Sampler(seed=3), biased=False)
    assert chi_square(first, ROW0.softmax(0)) < CHI2_5_999
    assert chi_square(second, ROW1.softmax(0)) < CHI2_5_999
    assert math.isclose(sum(second) / DRAWS, ROW0.softmax(0)[DRAFT].item(), abs_tol=0.03)


def test_a_biased_verifier_fails_the_same_test() -> None:
    first, _ = verified(Sampler(seed=3), biased=True)
    assert chi_square(first, ROW0.softmax(0)) > 10 * CHI2_5_999


# ---- drafts, acceptance, settings -------------------------------------------------------------------------------
def test_ngram_drafts_follow_the_latest_earlier_occurrence_of_the_longest_suffix() -> None:
    assert ngram_drafts([1, 2, 3, 9, 1, 2, 3, 7, 5, 1, 2, 3], 3, 1, 4) == [7, 5, 1]  # "1 2 3" last seen before 7
    assert ngram_drafts([4, 1, 2, 8, 3, 2], 2, 1, 3) == [8, 3]  # only "2" recurs
    assert ngram_drafts([1, 2, 3, 4], 3, 1, 4) == []  # nothing recurs
    assert ngram_drafts([5, 6, 5, 6], 3, 2, 2) == [5, 6]  # the context's end limits the draft
    assert ngram_drafts([7, 7, 7], 3, 1, 4) == [7]


def test_acceptance_stops_at_the_first_draft_that_differs() -> None:
    assert accepted_count([4, 5, 6], [4, 5, 6, 9]) == 3
    assert accepted_count([4, 5, 6], [4, 8, 6, 9]) == 1
    assert accepted_count([4, 5, 6], [1, 5, 6, 9]) == 0
    counters = SpecCounters()
    counters.count(3, 2)
    counters.count(2, 0)
    assert (counters.drafts, counters.draft_tokens, counters.accepted_tokens, counters.accepted_per_position) == \
        (2, 5, 2, [1, 1, 0])


def test_speculative_config_takes_vllms_shape_and_refuses_bad_values() -> None:
    parsed = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}')
    assert parsed == SpeculativeConfig("ngram", 5, 1, 3)
    assert SpeculativeConfig.parse({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2,
                                    "prompt_lookup_max": 2}) == SpeculativeConfig("ngram", 2, 2, 2)
    for bad, says in [("ngram", "JSON object"), ("[1]", "JSON object"),
                      (json.dumps({"method": "eagle", "num_speculative_tokens": 2}), "method must be one of"),
                      (json.dumps({"method": "ngram"}), "num_speculative_tokens"),
                      (json.dumps({"method": "ngram", "num_speculative_tokens": 0}), "from 1 to 16"),
                      (json.dumps({"method": "ngram", "num_speculative_tokens": 2, "draft": 1}), "unknown keys"),
                      (json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
                                   "prompt_lookup_max": 2}), "above prompt_lookup_max"),
                      (json.dumps({"method": "mtp", "num_speculative_tokens": 1, "prompt_lookup_min": 2}),
                       "apply to method 'ngram' only")]:
        with pytest.raises(ValueError, match=says):
            SpeculativeConfig.parse(bad)


# ---- the daemon -------------------------------------------------------------------------------------------------
def test_the_daemon_serves_with_ngram_drafts_the_same_greedy_text_and_counts_them(tmp_path) -> None:
    """`--speculative-config` as vLLM's JSON on the command line and as a mapping in --config: the same
    greedy completions (n=2, streamed and not) as without it, the drafts counted in /metrics, the
    setting shown by /version."""
    import subprocess
    import sys

    import httpx

    from tests.daemon import PATIENCE, ROOT, start_daemon

    text = "the cat sat on the mat and the cat sat on the mat and the cat sat on the mat and the cat"
    body = {"model": "v4serve-tiny", "prompt": text, "max_tokens": 24, "temperature": 0, "n": 2}
    config = tmp_path / "serve.yaml"
    config.write_text("speculative-config:\n  method: ngram\n  num_speculative_tokens: 3\n  prompt_lookup_max: 3\n")
    texts = []
    for args in (("--batch-invariant",), ("--batch-invariant", "--config", str(config))):
        daemon = start_daemon(*args)
        try:
            with httpx.Client(base_url=daemon.url, timeout=PATIENCE) as http:
                whole = http.post("/v1/completions", json=body).json()
                with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as streamed:
                    events = [json.loads(line[6:]) for line in streamed.iter_lines()
                              if line.startswith("data: {")]
                parts = {0: "", 1: ""}
                for event in events:
                    for choice in event["choices"]:
                        parts[choice["index"]] += choice["text"]
                assert [c["text"] for c in whole["choices"]] == [parts[0], parts[1]]
                texts.append(parts)
                metrics = http.get("/metrics").text
                drafts = float(next(line.split()[-1] for line in metrics.splitlines()
                                    if line.startswith("v4serve_spec_decode_num_drafts_total{")))
                version = http.get("/version").json()
        finally:
            daemon.stop()
    assert texts[0] == texts[1]
    assert drafts > 0 and version["speculative"].startswith("ngram, 3 draft tokens")
    bad = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "serve", "--no-kv-store", "--port", "0",
                          "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 0}'],
                         cwd=ROOT, capture_output=True, text=True, timeout=PATIENCE)
    assert bad.returncode == 2 and "num_speculative_tokens must be an integer from 1 to 16" in bad.stderr


# ---- structured outputs -----------------------------------------------------------------------------------------
def test_a_grammar_advances_over_kept_drafts_only_and_drafts_it_forbids_are_cut() -> None:
    """A request with a grammar (a Lark list of words here): drafts from its cold run, right or wrong,
    give its cold tokens and logits bit for bit, every output allowed; drafts the grammar forbids are
    cut before the pass (none proposed)."""
    from v4serve.engine.request import GrammarSpec
    from v4serve.server.text.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer()
    vocab = tokenizer.vocabulary_json()
    lark = 'start: item ("," item)*\nitem: "ab" | "cab" | "bca" | "abc"'

    def constrained() -> Request:
        grammar = GrammarSpec("lark", lark, "response_format")
        # EOS biased away: the list goes on to max_tokens rather than end where the grammar allows.
        params = SamplingParams(max_tokens=OUTPUT, logit_bias={tokenizer.eos_token_id: -100}, grammar=grammar)
        return Request("copy", PROMPTS["copy"][:40], params)

    truth, want, _ = run([constrained()], tokenizer_json=vocab)
    text = tokenizer.decode(truth["copy"])
    assert set(text) <= set("abc,") and text.count(",") >= 3  # the grammar held
    for wrong in (None, 0, 1):  # a wrong draft the grammar forbids is cut with those after it
        outputs, logits, engine = run([constrained()], oracle(truth, wrong), spec=NGRAM, tokenizer_json=vocab)
        assert outputs == truth and torch.equal(logits["copy"], want["copy"])
        if wrong is None:
            assert 0 < engine.spec.accepted_tokens == engine.spec.draft_tokens
    forbidden = lambda _: lambda request, most: tokenizer.encode("z") * most  # noqa: E731 - never allowed
    outputs, _, engine = run([constrained()], forbidden, spec=NGRAM, tokenizer_json=vocab)
    assert outputs == truth and engine.spec.draft_tokens == 0
