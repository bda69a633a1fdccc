"""A front end behind the engine sends what queued for a stream as one SSE chunk: the busier it is, the
less it does per token. Real HTTP through uvicorn, the engine in its own process; the front end's event
loop is held by the test until the engine has sent several steps, as a loaded front end would be."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.daemon import PATIENCE, in_process_server, wait_until
from v4serve.engine.request import Sample
from v4serve.server.serve import ServeConfig
from v4serve.server.text.output import Delta, joined, joins
from v4serve.server.text.tool_calls import ToolCallDelta

BODY = {"model": "v4serve-tiny", "prompt": "Once upon a time", "max_tokens": 40, "temperature": 0,
        "ignore_eos": True, "logprobs": 1}


def hold_the_loop_for_steps(engine, steps: int) -> threading.Event:
    """Block the front end's event loop until the engine has delivered `steps` more batches of output to
    it (they wait behind the block); the event is set once the loop runs again."""
    released = threading.Event()

    def block() -> None:
        heard, seen = engine._heard_at, 0  # the receiver thread stamps each batch it posts to the loop
        deadline = time.monotonic() + PATIENCE
        while seen < steps and time.monotonic() < deadline:
            if engine._heard_at != heard:
                heard, seen = engine._heard_at, seen + 1
            time.sleep(0.002)
        released.set()

    engine._loop.call_soon_threadsafe(block)
    return released


def test_deltas_queued_behind_a_busy_front_end_go_out_as_one_chunk() -> None:
    with in_process_server(ServeConfig(no_kv_store=True, preprocess_workers=0)) as (url, engine):
        whole = httpx.post(url + "/v1/completions", json=BODY, timeout=PATIENCE).json()["choices"][0]
        chunks = []
        with httpx.stream("POST", url + "/v1/completions", json={**BODY, "stream": True}, timeout=PATIENCE) as r:
            lines = (line[len("data: "):] for line in r.iter_lines() if line)
            chunks.append(json.loads(next(lines)))
            wait_until(hold_the_loop_for_steps(engine, 4).is_set, "the engine to send four steps")
            chunks += [json.loads(line) for line in lines if line != "[DONE]"]
    texts = [c["choices"][0]["text"] for c in chunks]
    tokens = [len(c["choices"][0]["logprobs"]["tokens"]) for c in chunks]
    assert "".join(texts) == whole["text"]
    assert sum(tokens) == 40 and len(chunks) < 40
    assert max(tokens) >= 2  # the steps that waited behind the block: one chunk
    merged = [c for c in chunks if len(c["choices"][0]["logprobs"]["tokens"]) >= 2]
    for c in merged:  # each token keeps its own logprob entry in the chunk
        lp = c["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == len(lp["tokens"]) == len(lp["top_logprobs"])
    flat = [t for c in chunks for t in c["choices"][0]["logprobs"]["tokens"]]
    assert flat == whole["logprobs"]["tokens"]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def sample(token: int) -> Sample:
    return Sample(token, -0.5, [])


def test_what_one_chunk_can_say_in_order() -> None:
    a = Delta(0, "Hel", token_ids=[1], samples=[sample(1)])
    b = Delta(0, "lo", token_ids=[2], samples=[sample(2)], finished=True, finish_reason="stop")
    assert joins(a, b, text_before=True)
    assert joined([a, b]) == Delta(0, "Hello", token_ids=[1, 2], samples=[sample(1), sample(2)], finished=True,
                                   finish_reason="stop")
    thinking = Delta(0, reasoning="hm", token_ids=[3])
    assert joins(thinking, a, text_before=False)  # reasoning, then content: in order
    assert joined([thinking, a]) == Delta(0, "Hel", "hm", [3, 1], [sample(1)])
    assert not joins(a, thinking, text_before=True)  # content then reasoning: one chunk would reorder them
    assert not joins(Delta(0, token_ids=[4]), thinking, text_before=True)  # content anywhere earlier in the run
    assert not joins(a, Delta(1, "x"), text_before=True)  # another choice
    assert not joins(b, a, text_before=True)  # nothing after an end
    assert not joins(a, Delta(0, error="boom", finished=True), text_before=True)
    call = Delta(0, tool_calls=[ToolCallDelta(0, arguments='{"a"')])
    assert not joins(a, call, text_before=True) and not joins(call, a, text_before=False)


def test_a_long_backlog_joins_in_one_pass() -> None:
    run = [Delta(0, f"{i},", token_ids=[i], samples=[sample(i)]) for i in range(20_000)]
    one = joined(run)
    assert one.text == "".join(f"{i}," for i in range(20_000)) and one.token_ids == list(range(20_000))
    assert [s.token for s in one.samples] == list(range(20_000)) and not one.finished
