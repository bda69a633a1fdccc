"""--batch-invariant over HTTP: a chat's follow-up turn served from the cache gives the cold run's
log-probs bitwise — resumed where turn 1's response ended, from a sealed block's snapshot, or
rebuilt by a zero-mode recompute. Turn 1's reply was written into the cache by decode steps and is
read back by turn 2; the cold daemon computes the same tokens in a prefill. Turn ends fall before,
on and after the embedded model's block and window edge (both 128 tokens).

Replies are held to lowercase letters (logit_bias), so the reply's text tokenizes back into the
reply's tokens and turn 2's prompt extends turn 1's sequence exactly."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from tests.daemon import PATIENCE, daemon
from tests.test_store_daemon import metric

MODEL = "v4serve-tiny"
LETTERS = {str(161 + i): 100 for i in range(26)}  # the byte tokenizer's 'a'..'z'
BLOCK = 128  # the embedded model's block and window
FLAGS = ("--attention-backend", "torch", "--batch-invariant")


@pytest.fixture(scope="module")
def cold_url() -> Iterator[str]:
    with daemon(*FLAGS, "--no-prefix-caching") as url:
        yield url


@pytest.fixture(scope="module", params=["periodic", "full", "zero"])
def cached(request: pytest.FixtureRequest) -> Iterator[tuple[str, str]]:
    with daemon(*FLAGS, "--swa-cache-mode", request.param) as url:
        yield request.param, url


def chat(url: str, messages: list[dict], n: int, salt: str) -> dict:
    body = {"model": MODEL, "messages": messages, "max_tokens": n, "temperature": 0, "logit_bias": LETTERS,
            "logprobs": True, "top_logprobs": 5, "ignore_eos": True, "cache_salt": salt}
    resp = httpx.post(url + "/v1/chat/completions", json=body, timeout=PATIENCE)
    assert resp.status_code == 200, resp.text
    return resp.json()


def prompt_tokens(url: str, messages: list[dict]) -> int:
    resp = httpx.post(url + "/tokenize", json={"model": MODEL, "messages": messages}, timeout=PATIENCE)
    assert resp.status_code == 200, resp.text
    return resp.json()["count"]


def conversation(url: str, end: int, prompt_len: int, salt: str) -> tuple[list[dict], str]:
    """Turn 1 of a chat: a prompt of `prompt_len` tokens and a reply whose last computed token is at
    position `end`. Returns the messages so far, with the reply, and the reply."""
    filler = "Spell something for me, please. " * (prompt_len // 32 + 1)
    messages = [{"role": "system", "content": "Letters only."}, {"role": "user", "content": ""}]
    chars = prompt_len - prompt_tokens(url, messages)  # one byte, one token
    messages[1]["content"] = filler[:chars]
    assert chars >= 0 and prompt_tokens(url, messages) == prompt_len
    n = end - prompt_len + 1  # the last reply token is sampled, never computed
    reply = chat(url, messages, n, salt)["choices"][0]["message"]["content"]
    assert len(reply) == n and reply.isalpha() and reply.islower()
    return [*messages, {"role": "assistant", "content": reply}], reply


def restores(url: str) -> dict[str, float]:
    return {p: metric(url, "v4serve_prefix_cache_restores_total", point=p)
            for p in ("block", "snapshot", "response_end", "recompute")}


@pytest.mark.parametrize("end", [BLOCK - 1, BLOCK, BLOCK + 1, 2 * BLOCK - 1, 2 * BLOCK, 2 * BLOCK + 1])
def test_a_follow_up_turn_is_bitwise_the_cold_run(cached: tuple[str, str], cold_url: str, end: int) -> None:
    """Periodic and full resume at the response end (on a block edge: the block's snapshot); zero
    rebuilds the window from the sealed blocks. Either way turn 2's tokens and every log-prob (top 5
    included) equal the cold daemon's."""
    mode, url = cached
    salt = f"{mode}-{end}"
    history, _ = conversation(url, end, end - 11, salt)  # a reply of 12 tokens
    follow_up = [*history, {"role": "user", "content": "And once more."}]
    before = restores(url)
    hit = chat(url, follow_up, 6, salt)
    used = {p: restores(url)[p] - n for p, n in before.items()}
    cold = chat(cold_url, follow_up, 6, salt)
    if mode == "zero":  # no snapshots: a hit of sealed blocks, the window state recomputed
        assert used == {"block": 0, "snapshot": 0, "response_end": 0, "recompute": int(end >= BLOCK)}
    else:  # a response ending on a block edge is that block's snapshot
        point = "block" if end % BLOCK == 0 else "response_end"
        assert used == {p: int(p == point) for p in used}
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == end
    assert hit["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    assert hit["choices"][0]["message"] == cold["choices"][0]["message"]


def test_a_long_conversation_is_bitwise_the_cold_run(cached: tuple[str, str], cold_url: str) -> None:
    """A 1,000-token prompt and a 100-token reply: turn 1's reply sees hundreds of compressed entries
    and its indexer picks 16 of them, among exact ties (a score is 0 wherever every head's relu is)
    that a decode step and a prefill chunk must break the same way."""
    mode, url = cached
    end, salt = 1100, f"long-{mode}"
    history, _ = conversation(url, end, end - 99, salt)
    follow_up = [*history, {"role": "user", "content": "And once more."}]
    hit = chat(url, follow_up, 8, salt)
    cold = chat(cold_url, follow_up, 8, salt)
    assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] > 0 or mode == "zero"
    assert hit["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    assert hit["choices"][0]["message"] == cold["choices"][0]["message"]


def test_an_edited_history_restores_a_sealed_block_bitwise(cached: tuple[str, str], cold_url: str) -> None:
    """Turn 1's reply edited inside the tail after its last sealed block (a prompt of 130 tokens,
    the reply up to 276): the hit ends at that block (256). Full restores the block's snapshot,
    periodic the one at the prompt's last boundary (128) and recomputes 128 tokens, zero recomputes
    from nothing; turn 2 equals the cold run bitwise each way."""
    mode, url = cached
    end, salt = 2 * BLOCK + 20, f"edited-{mode}"
    history, reply = conversation(url, end, BLOCK + 2, salt)
    edited = reply[:-3] + ("a" if reply[-3] != "a" else "b") + reply[-2:]  # position end - 2
    follow_up = [*history[:-1], {"role": "assistant", "content": edited}, {"role": "user", "content": "Again."}]
    before = restores(url)
    hit = chat(url, follow_up, 6, salt)
    used = {p: restores(url)[p] - n for p, n in before.items()}
    cold = chat(cold_url, follow_up, 6, salt)
    point = {"full": "block", "periodic": "snapshot", "zero": "recompute"}[mode]
    assert used == {p: int(p == point) for p in used}
    skipped = {"full": 2 * BLOCK, "periodic": BLOCK}.get(mode)  # the restore point: computing resumes there
    if skipped is not None:
        assert hit["usage"]["prompt_tokens_details"]["cached_tokens"] == skipped
    assert hit["choices"][0]["logprobs"] == cold["choices"][0]["logprobs"]
    assert hit["choices"][0]["message"] == cold["choices"][0]["message"]
