"""Async scheduling (engine/overlap.py): step N+1 launched before step N's tokens are read gives the
same outputs as steps run in series: greedy token for token, seeded draws the same, logprobs within
fp32 noise, across stops, lengths, aborts, block pressure, prefix hits from device and disk, snapshots,
and the features whose sampling needs the last token (which run those steps in series)."""

from __future__ import annotations

import contextlib
import json

import httpx
import pytest
import torch

from tests.daemon import PATIENCE, daemon
from tests.helpers import engine_for, greedy, small_model, tokens
from v4serve.engine.engine import EngineConfig, LLMEngine
from v4serve.engine.overlap import async_scheduling
from v4serve.engine.request import GrammarSpec, Request, SamplingParams
from v4serve.engine.speculative import SpeculativeConfig

Outputs = dict[str, tuple[list[int], list[float], str | None]]


def drive(engine: LLMEngine, arrivals: dict[int, list[Request]], aborts: dict[int, list[str]] | None = None,
          watch: list[bool] | None = None) -> Outputs:
    """Step to completion, adding requests and aborting ids at the given step numbers; the cache's
    integrity is checked after every step. → each request's tokens, their logprobs and finish reason.
    `watch` gets, per step, whether a step was left in flight."""
    got: Outputs = {}
    step = 0
    while step <= max([*arrivals, *(aborts or {})]) or engine.has_work():
        for r in arrivals.get(step, []):
            engine.add_request(r)
            got[r.request_id] = ([], [], None)
        for rid in (aborts or {}).get(step, []):
            engine.abort(rid)
        for out in engine.step():
            toks, lps, reason = got[out.request_id]
            assert reason is None, f"{out.request_id} had output after it finished"
            assert out.error is None, out.error
            got[out.request_id] = (toks + out.new_token_ids, lps + [s.logprob for s in out.samples],
                                   out.finish_reason if out.finished else None)
        engine.kv.check_integrity([r.kv for r in engine.scheduler.running])
        if watch is not None:
            watch.append(engine._in_flight is not None)
        step += 1
    return got


def assert_same(series: Outputs, ahead: Outputs) -> None:
    assert series.keys() == ahead.keys()
    for rid, (toks, lps, reason) in series.items():
        assert ahead[rid][0] == toks, rid
        assert ahead[rid][2] == reason, rid
        assert torch.allclose(torch.tensor(ahead[rid][1]), torch.tensor(lps), atol=1e-4), rid


def both(make, arrivals_of, **engine_overrides) -> tuple[Outputs, Outputs, LLMEngine]:
    """The same requests in series and launched ahead → (in series, ahead, the engine that ran ahead)."""
    series = drive(engine_for(small_model(), async_scheduling="off", **engine_overrides), arrivals_of(make))
    engine = engine_for(small_model(), async_scheduling="on", **engine_overrides)
    watch: list[bool] = []
    ahead = drive(engine, arrivals_of(make), watch=watch)
    assert sum(watch) > len(watch) // 2, "most steps must leave one in flight"
    return series, ahead, engine


def mixed(make: int) -> dict[int, list[Request]]:
    """Prompts crossing the small model's 16-token blocks and 8-token window, off by one each side,
    arriving while others decode; greedy and seeded choices, logprobs, stops and lengths."""
    block = 16
    lengths = [block - 1, block, block + 1, 2 * block - 1, 2 * block + 1, 8, 9, 7, 45]
    reqs = [greedy(f"g{n}", tokens(n, n), n=3 + n % 11) for n in lengths]
    shared = tokens(2 * block, 77)
    reqs += [Request(f"seed{c}", shared + tokens(5, 3), SamplingParams(max_tokens=12, temperature=0.9, top_p=0.9,
                                                                       seed=42, choice_index=c, logprobs=3))
             for c in range(2)]
    stops = list(range(64, 180))  # about a third of the tokens stop the request
    reqs += [Request("stop", tokens(20, 5), SamplingParams(max_tokens=30, stop_token_ids=stops)),
             Request("stop-late", tokens(20, 6), SamplingParams(max_tokens=30, min_tokens=4, stop_token_ids=stops,
                                                                temperature=1.0, seed=3)),
             Request("one", tokens(17, 7), SamplingParams(max_tokens=1, ignore_eos=True)),
             Request("prompt-lp", tokens(33, 8), SamplingParams(max_tokens=4, prompt_logprobs=2, ignore_eos=True)),
             Request("model-len", tokens(100, 9), SamplingParams(max_tokens=10, ignore_eos=True))]
    return {0: reqs[:5], 2: reqs[5:9], 3: reqs[9:12], 6: reqs[12:]}


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_outputs_equal_the_steps_in_series(prefix_caching):
    series, ahead, _ = both(0, mixed, max_num_seqs=6, max_prefill_chunk=13, max_num_batched_tokens=40,
                            max_model_len=110, enable_prefix_caching=prefix_caching)
    assert series["stop"][2] == "stop" and len(series["stop"][0]) < 30
    assert series["model-len"][2] == "length" and len(series["model-len"][0]) == 10
    assert series["one"][0] and len(series["one"][0]) == 1
    assert series["seed0"][0] != series["seed1"][0]  # two choices, two streams
    assert_same(series, ahead)


def test_a_response_ended_by_a_stop_token_is_resumed_by_the_next_turn():
    """Launched ahead, the stop token was computed by the step after it: the response's end is kept one
    token further, and the conversation's next turn (which carries that token) resumes right there."""
    first = Request("t1", tokens(40, 21), SamplingParams(max_tokens=40, stop_token_ids=list(range(64, 140))))
    engine = engine_for(small_model(), async_scheduling="on", swa_cache_mode="full")
    out = drive(engine, {0: [first]})
    said, reason = out["t1"][0], out["t1"][2]
    assert reason == "stop" and said[-1] in range(64, 140)
    follow = [*first.prompt_token_ids, *said, *tokens(5, 22)]
    second = greedy("t2", follow, n=8)
    drive(engine, {0: [second]})
    assert second.num_cached_tokens == len(first.prompt_token_ids) + len(said)  # stop token included
    cold = greedy("cold", follow, n=8)
    drive(engine_for(small_model(), async_scheduling="off", enable_prefix_caching=False), {0: [cold]})
    assert second.output_token_ids == cold.output_token_ids


def test_block_pressure_never_preempts_a_request_with_a_token_in_flight():
    engine = engine_for(small_model(), async_scheduling="on", max_num_seqs=3, num_blocks=9, max_prefill_chunk=64,
                        swa_cache_mode="full")
    preempted: list[int] = []
    preempt = engine.scheduler._preempt

    def checked(request, scheduled):
        preempted.append(request.pending_tokens)
        preempt(request, scheduled)

    engine.scheduler._preempt = checked
    reqs = lambda: {0: [greedy(f"r{i}", tokens(40, 10 + i), n=40) for i in range(3)]}  # noqa: E731
    ahead = drive(engine, reqs())
    assert preempted and set(preempted) == {0}  # there was pressure, and no victim had a token in flight
    series = drive(engine_for(small_model(), async_scheduling="off", max_num_seqs=3, num_blocks=9,
                              max_prefill_chunk=64, swa_cache_mode="full"), reqs())
    assert_same(series, ahead)


def test_an_abort_with_a_token_in_flight_drops_that_token_and_nothing_else():
    reqs = lambda: [greedy(f"r{i}", tokens(20 + i, 30 + i), n=20) for i in range(3)]  # noqa: E731
    engine = engine_for(small_model(), async_scheduling="on")
    for r in reqs():
        engine.add_request(r)
    got: dict[str, list[int]] = {f"r{i}": [] for i in range(3)}
    while not (engine._in_flight and any(c.request.request_id == "r1" for c in engine._in_flight.sampled)
               and got["r1"]):
        for out in engine.step():
            got[out.request_id] += out.new_token_ids
    assert engine.abort("r1")
    while engine.has_work():
        for out in engine.step():
            assert out.request_id != "r1", "an aborted request's token in flight was sent"
            got[out.request_id] += out.new_token_ids
        engine.kv.check_integrity([r.kv for r in engine.scheduler.running])
    assert engine.scheduler.kv.stats().state_cache_usage == 0  # every slot back
    series = drive(engine_for(small_model(), async_scheduling="off"), {0: reqs()})
    assert got["r0"] == series["r0"][0] and got["r2"] == series["r2"][0]
    assert got["r1"] == series["r1"][0][:len(got["r1"])]


def test_hits_from_the_ssd_store_and_snapshots_equal_the_steps_in_series(tmp_path):
    block = 16
    doc = tokens(5 * block + 3, 50)

    def waves(engine: LLMEngine) -> tuple[Outputs, Outputs]:
        first = drive(engine, {0: [greedy("a", doc + tokens(4, 51), n=9)]})
        engine.reset_prefix_cache()  # device copies gone: the second wave reads the SSD store
        second = drive(engine, {0: [greedy("b", doc + tokens(6, 52), n=9),
                                    greedy("c", doc[:3 * block + 1] + tokens(2, 53), n=9)]})
        return first, second

    settings = dict(swa_checkpoint_interval=2 * block, kv_store_read_timeout=PATIENCE)
    series = waves(engine_for(small_model(), async_scheduling="off", kv_store_dir=str(tmp_path / "s"), **settings))
    engine = engine_for(small_model(), async_scheduling="on", kv_store_dir=str(tmp_path / "a"), **settings)
    ahead = waves(engine)
    assert engine.scheduler.stats.prefix_hits_disk > 0
    for s, a in zip(series, ahead, strict=True):
        assert_same(s, a)


def test_sampling_that_needs_the_last_token_is_prepared_after_it_is_read():
    """A grammar mask, penalties and a thinking budget read the tokens before the row: a step's rows are
    prepared once the step before has been read (never with a token in flight), its forward launched
    before that; the steps stay launched ahead and the output is the same as in series."""
    from v4serve.server.text.tokenizer import ByteTokenizer

    vocab = ByteTokenizer().vocabulary_json()
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    spec = GrammarSpec("json_schema", json.dumps(schema), "response_format")

    def arrivals(_: int) -> dict[int, list[Request]]:
        return {0: [greedy("plain", tokens(20, 60), n=24),
                    Request("grammar", tokens(12, 61), SamplingParams(max_tokens=40, grammar=spec))],
                4: [Request("penalties", tokens(30, 62), SamplingParams(max_tokens=12, repetition_penalty=1.3,
                                                                        frequency_penalty=0.5, ignore_eos=True)),
                    Request("budget", tokens(10, 63), SamplingParams(max_tokens=12, thinking_budget=3,
                                                                     thinking_end_token=70, ignore_eos=True))]}

    engine = engine_for(small_model(), async_scheduling="on", tokenizer_json=vocab)
    prepare = engine.sampler.prepare
    prepared: list[tuple[str, int]] = []

    def checked(request, drafted=()):
        prepared.append((request.request_id, request.pending_tokens))
        return prepare(request, drafted)

    engine.sampler.prepare = checked
    watch: list[bool] = []
    ahead = drive(engine, arrivals(0), watch=watch)
    assert {rid for rid, _ in prepared} == {"plain", "grammar", "penalties", "budget"}
    assert {pending for _, pending in prepared} == {0}
    assert sum(watch) > len(watch) // 2  # launched ahead all along
    series = drive(engine_for(small_model(), async_scheduling="off", tokenizer_json=vocab), arrivals(0))
    assert json.loads(ByteTokenizer().decode(ahead["grammar"][0])) in ({"ok": True}, {"ok": False})
    assert_same(series, ahead)


def test_when_async_scheduling_is_on():
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert async_scheduling("auto", cuda, False) == "on"
    assert async_scheduling("on", cpu, False) == "on"
    assert async_scheduling("auto", cpu, False).startswith("off (auto: the forward is synchronous")
    assert async_scheduling("off", cuda, False) == "off (--async-scheduling off)"
    assert async_scheduling("on", cuda, True).startswith("off (speculative decoding")
    with pytest.raises(ValueError, match="--async-scheduling must be one of auto, on, off"):
        async_scheduling("yes", cuda, False)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=2)
    engine = LLMEngine(small_model(), EngineConfig(max_model_len=256, async_scheduling="on", speculative=spec))
    assert engine.async_scheduling.startswith("off (speculative")


def test_the_daemon_launches_ahead_with_the_same_replies(base_url):
    ask = {"model": "v4serve-tiny", "messages": [{"role": "user", "content": "Tell me about caches."}],
           "max_tokens": 24, "temperature": 0.8, "seed": 9, "n": 2, "logprobs": True, "top_logprobs": 2}
    with daemon("--async-scheduling", "on") as url:
        assert httpx.get(url + "/version", timeout=PATIENCE).json()["async_scheduling"] == "on"
        ahead = httpx.post(url + "/v1/chat/completions", json=ask, timeout=PATIENCE).json()
        streamed = httpx.post(url + "/v1/chat/completions", json={**ask, "stream": True}, timeout=PATIENCE).text
    series = httpx.post(base_url + "/v1/chat/completions", json=ask, timeout=PATIENCE).json()
    assert httpx.get(base_url + "/version", timeout=PATIENCE).json()["async_scheduling"].startswith("off (auto")
    texts = [c["message"]["content"] for c in ahead["choices"]]
    assert texts == [c["message"]["content"] for c in series["choices"]]
    assert ahead["usage"] == series["usage"]
    pieces: dict[int, str] = {0: "", 1: ""}
    for line in streamed.splitlines():
        if line.startswith("data: {"):
            for choice in json.loads(line[6:])["choices"]:
                pieces[choice["index"]] += choice["delta"].get("content") or ""
    assert [pieces[0], pieces[1]] == texts


def test_launching_the_sampling_and_the_next_inputs_never_waits_for_the_device():
    """What the host does between launching step N and launching step N+1 on the device: prepare and
    launch the sampling (min_tokens counting the tokens in flight, a logit bias, top logprobs) and write
    step N's tokens into step N+1's inputs. On the `meta` device any value read back would fail or be
    recorded; none is."""
    from v4serve.engine.overlap import InFlight
    from v4serve.engine.sampler import HostCopy, SampledRows, Sampler
    from v4serve.kernels.launches import HostSyncs

    sampler = Sampler(0, eos_token_id=1)
    requests = [Request(f"r{i}", [5, 6, 7], SamplingParams(max_tokens=8, logprobs=2, min_tokens=3,
                                                           logit_bias={9: 1.0})) for i in range(6)]
    for r in requests:
        r.pending_tokens = 1
    logits = torch.zeros(6, 1000, device="meta")
    inputs = torch.zeros(10, dtype=torch.long, device="meta")
    with HostSyncs() as syncs:
        result = sampler.on_device([sampler.prepare(r) for r in requests], logits)
        ahead = InFlight([], SampledRows(result[:, 0].long(), HostCopy(result, result, None), []))
        LLMEngine._fill_inputs(inputs, ahead, ([1, 3, 5], [0, 2, 4]))
    assert syncs.found == []
    with HostSyncs() as syncs, contextlib.suppress(NotImplementedError):
        result.tolist()  # what reading the samples does (a step later)
    assert any("Tensor.tolist()" in found for found in syncs.found)
