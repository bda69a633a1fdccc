"""Agent frameworks, unmodified, against a real daemon (the tiny model under DeepSeek's names too):
pydantic-ai's `openai:` prefix (the Responses API), langchain-openai with `use_responses_api=True`,
and DeepSeek's own harness CLI (`dsh doctor`, DeepSeek's base URL without `/v1`)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import pytest
from pydantic import BaseModel

from tests.daemon import PATIENCE, daemon

MODEL = "v4serve-tiny"


class Verdict(BaseModel):
    ok: bool
    grade: Literal["a", "b", "c"]


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with daemon("--served-model-name", MODEL, "deepseek-v4-flash", "deepseek-chat", "deepseek-reasoner") as served:
        yield served


def test_pydantic_ai_openai_prefix_gives_its_output_type(url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from pydantic_ai import Agent
    from pydantic_ai.settings import ModelSettings

    monkeypatch.setenv("OPENAI_BASE_URL", url + "/v1")
    monkeypatch.setenv("OPENAI_API_KEY", "unused")
    agent = Agent(f"openai:{MODEL}", output_type=Verdict, model_settings=ModelSettings(temperature=0, max_tokens=300))
    result = agent.run_sync("Is this good?")
    assert isinstance(result.output, Verdict)
    assert result.usage.input_tokens > 0


def test_langchain_with_the_responses_api(url: str) -> None:
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", use_responses_api=True, temperature=0,
                     max_tokens=8, timeout=PATIENCE, max_retries=0)
    reply = llm.invoke("Hello")
    assert isinstance(reply.text, str) and reply.usage_metadata["input_tokens"] > 0
    longer = ChatOpenAI(model=MODEL, base_url=url + "/v1", api_key="unused", use_responses_api=True, temperature=0,
                        max_tokens=300, timeout=PATIENCE, max_retries=0)
    assert isinstance(longer.with_structured_output(Verdict, method="json_schema").invoke("Judge this."), Verdict)
    assert "".join(chunk.text for chunk in llm.stream("Hello")) == reply.text


def test_deepseeks_harness_cli_doctor(url: str) -> None:
    """`dsh doctor`: a live call at DeepSeek's base URL (no /v1) under DeepSeek's model name. Its
    `--node` probes mostly inspect local files of DeepSeek's Node harness and do not apply to a server;
    the one that calls the API (P1, the reasoner wire) runs but needs a model that calls tools unasked."""
    dsh = Path(sys.executable).parent / "dsh"
    env = {**os.environ, "DEEPSEEK_API_KEY": "unused", "DEEPSEEK_BASE_URL": url}
    done = subprocess.run([str(dsh), "doctor", "--model", "deepseek-v4-flash"], env=env, capture_output=True,
                          text=True, timeout=PATIENCE)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "harness ready" in done.stdout and "call.finish_reason" in done.stdout
