"""`v4serve serve --model tiny-v41`: the real daemon serving the embedded DeepSeek-V4.1 model, driven by
the OpenAI and Anthropic SDKs on every API surface; the same long prompt again is a device hit with the
same greedy tokens, and after a restart a disk hit."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import openai
import pytest

from tests.daemon import PATIENCE, daemon

MODEL = "v4serve-tiny-v41"
# Past two 128-token blocks in the byte tokenizer, and the same text again next time.
DOCUMENT = "The split cache keeps a window per layer and entries per source. " * 5


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("v41store")


@pytest.fixture(scope="module")
def url(store: Path) -> Iterator[str]:
    with daemon("--model", "tiny-v41", "--kv-store-dir", str(store)) as base:
        yield base


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="none", timeout=PATIENCE, max_retries=0)


def _ask(client: openai.OpenAI) -> tuple[str, int]:
    # Thinking named: the embedded model's default is chat mode, a checkpoint folder's DeepSeek's (thinking).
    reply = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": DOCUMENT}],
                                           max_tokens=6, temperature=0,
                                           extra_body={"chat_template_kwargs": {"thinking": False}})
    usage = reply.usage
    assert usage is not None and usage.prompt_tokens_details is not None
    return reply.choices[0].message.content or "", usage.prompt_tokens_details.cached_tokens or 0


def test_it_says_what_it_serves(url: str) -> None:
    version = httpx.get(url + "/version", timeout=PATIENCE).json()
    assert version["model_family"] == "v4.1"
    assert [m.id for m in _client(url).models.list()] == [MODEL]


def test_every_surface_answers(url: str) -> None:
    client = _client(url)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                          max_tokens=5, temperature=0)
    assert chat.choices[0].finish_reason == "length" and chat.usage is not None
    assert chat.usage.completion_tokens == 5
    streamed = list(client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello"}],
                                                   max_tokens=5, temperature=0, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in streamed if c.choices)
    assert text == chat.choices[0].message.content  # greedy: the same tokens streamed or not
    done = client.completions.create(model=MODEL, prompt="hello", max_tokens=3, temperature=0, echo=True, logprobs=1)
    assert done.choices[0].text.startswith("hello") and done.choices[0].logprobs is not None
    response = client.responses.create(model=MODEL, input="hello", max_output_tokens=4, temperature=0)
    assert response.status == "incomplete" and response.usage is not None and response.usage.output_tokens == 4
    message = anthropic.Anthropic(base_url=url, api_key="none", timeout=PATIENCE, max_retries=0).messages.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "hello"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4


def test_the_same_document_again_is_a_hit_with_the_same_answer(url: str) -> None:
    client = _client(url)
    first, cached_first = _ask(client)
    again, cached_again = _ask(client)
    assert cached_first == 0 and cached_again >= 2 * 128
    assert again == first


def test_after_a_restart_the_document_is_a_disk_hit(url: str, store: Path) -> None:
    first, _ = _ask(_client(url))  # in the store by now (the test above, or this call)
    with daemon("--model", "tiny-v41", "--kv-store-dir", str(store)) as restarted:
        again, cached = _ask(_client(restarted))
        metrics = httpx.get(restarted + "/metrics", timeout=PATIENCE).text
    assert cached >= 2 * 128 and again == first
    disk = [line for line in metrics.splitlines()
            if line.startswith("v4serve_prefix_cache_hits_total{") and 'source="disk"' in line]
    assert len(disk) == 1 and float(disk[0].rsplit(" ", 1)[1]) >= 2 * 128, "the hit came from the store's files"


def test_a_v41_checkpoint_folder_serves_the_same_answers(url: str, tmp_path: Path) -> None:
    """make-checkpoint's tiny-v41 folder, served by --model FOLDER: its config.json
    says V4.1 and its tokenizer.json gives the Engram map, so it answers as the embedded model does."""
    folder = tmp_path / "tiny-v41"
    subprocess.run([sys.executable, "-m", "v4serve.server.cli", "make-checkpoint", str(folder), "--model",
                    "tiny-v41"], check=True, capture_output=True, timeout=PATIENCE)
    embedded, _ = _ask(_client(url))
    with daemon("--model", str(folder), "--served-model-name", MODEL) as served:
        version = httpx.get(served + "/version", timeout=PATIENCE).json()
        answer, _ = _ask(_client(served))
    assert version["model_family"] == "v4.1"
    assert answer == embedded


PNG = "iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mP8z8BQDwAEhQGAhKmMIQAAAABJRU5ErkJggg=="


def test_an_image_is_refused_by_name_on_every_surface_and_nothing_else_is_lost(url: str) -> None:
    """V4.1's format writes an image as its placeholder; the vision tower is not served yet, so a request with
    one is a 400 saying so (never a placeholder read with no image behind it), and the daemon serves on."""
    image_url = {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
    chat = {"model": MODEL, "max_tokens": 4,
            "messages": [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, image_url]}]}
    with httpx.Client(base_url=url, timeout=PATIENCE) as client:
        rendered = client.post("/v1/chat/completions/render", json=chat)
        assert rendered.status_code == 200 and "<｜image｜>" in rendered.json()["prompt"]
        refused = [
            client.post("/v1/chat/completions", json=chat),
            client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": [{"role": "user",
                        "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                 "data": PNG}},
                                    {"type": "text", "text": "What is this?"}]}]}),
            client.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 4, "input": [{"role": "user",
                        "content": [{"type": "input_text", "text": "What is this?"},
                                    {"type": "input_image", "image_url": f"data:image/png;base64,{PNG}"}]}]}),
        ]
        for reply in refused:
            assert reply.status_code == 400, reply.text
            assert "images are not read yet" in reply.text
        # The placeholder's literal in text is text, not an image.
        literal = client.post("/v1/chat/completions", json={**chat, "messages": [
            {"role": "user", "content": "a literal <｜image｜> in text"}]})
        assert literal.status_code == 200, literal.text
