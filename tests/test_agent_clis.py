"""The agent CLIs people run, unmodified, against a real daemon: Claude Code (`-p`, json and stream-json),
Codex (`exec`, Responses API), opencode (`run`, chat completions) and aider (`--message`), as pinned and
installed by `make agents` (a dependency of `make test`). Each finishes a turn with default settings but
the base URL and a model name the daemon serves, then a follow-up turn of the same conversation whose
usage, as the client itself reports it, shows cached tokens. The model is `tests/greeter.py`'s: every
turn is "Hi!", so a turn ends in four tokens. Each client runs with a fresh HOME in an empty folder."""

from __future__ import annotations

import json
import os
import re
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.daemon import PATIENCE, ROOT, daemon
from tests.greeter import ANSWER, write_greeter

MODEL = "v4serve-tiny"
AGENTS = ROOT / ".agents"
CLAUDE = AGENTS / "npm" / "node_modules" / ".bin" / "claude"
CODEX = AGENTS / "npm" / "node_modules" / ".bin" / "codex"
OPENCODE = AGENTS / "npm" / "node_modules" / ".bin" / "opencode"
AIDER = AGENTS / "aider" / "bin" / "aider"


def installed(binary: Path, name: str) -> Any:
    return pytest.mark.skipif(not binary.exists(), reason=f"{name} is not installed: `make agents` installs it "
                                                          f"(the npm CLIs need npm, from Node.js)")


@pytest.fixture(scope="module")
def url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("greeter")
    write_greeter(folder)
    # Claude Code and opencode ask for 32,000 output tokens: the context must hold their prompt and that.
    with daemon("--model", str(folder), "--served-model-name", MODEL, "--max-model-len", "65536",
                "--no-kv-store") as served:
        yield served


def run(args: list[str | Path], home: Path, env: dict[str, str] | None = None) -> str:
    """The client's stdout, run in an empty folder under a fresh HOME with nothing read from stdin."""
    work = home.parent / "work"
    work.mkdir(exist_ok=True)
    base = {"PATH": os.environ["PATH"], "HOME": str(home), "LANG": "C.UTF-8", "TERM": "dumb",
            **{f"XDG_{d}_HOME": str(home / d.lower()) for d in ("CONFIG", "DATA", "CACHE", "STATE")}}
    done = subprocess.run([str(a) for a in args], cwd=work, env={**base, **(env or {})}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=PATIENCE)
    assert done.returncode == 0, f"{args[0]} exited {done.returncode}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


def home_for(tmp_path: Path) -> Path:
    home = tmp_path / "home"
    home.mkdir()
    return home


@installed(CLAUDE, "Claude Code")
def test_claude_code_finishes_a_turn_and_its_follow_up_reads_the_cache(url: str, tmp_path: Path) -> None:
    """`--bare` keeps the prompt short (3 tools, no long system prompt); the non-essential traffic
    (telemetry, the connectivity probe) is off so a test run sends nothing to Anthropic."""
    home = home_for(tmp_path)
    env = {"ANTHROPIC_BASE_URL": url, "ANTHROPIC_API_KEY": "sk-unused", "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1"}
    first = json.loads(run([CLAUDE, "-p", "Say hi", "--bare", "--model", MODEL, "--output-format", "json"], home, env))
    assert (first["subtype"], first["is_error"], first["result"]) == ("success", False, ANSWER)
    assert first["usage"]["input_tokens"] > 500 and first["usage"]["output_tokens"] > 0
    events = [json.loads(line) for line in run([CLAUDE, "-p", "Again", "--continue", "--bare", "--model", MODEL,
                                                "--output-format", "stream-json", "--verbose"], home, env).splitlines()]
    result = events[-1]
    assert (result["type"], result["subtype"], result["result"]) == ("result", "success", ANSWER)
    # The whole first turn comes from the cache, to the end of its answer (a response-end hit).
    assert result["usage"]["cache_read_input_tokens"] > first["usage"]["input_tokens"]
    assert any(e["type"] == "assistant" for e in events)


CODEX_CONFIG = """model = "{model}"
model_provider = "v4serve"

[model_providers.v4serve]
name = "v4serve"
base_url = "{url}/v1"
env_key = "V4SERVE_API_KEY"
wire_api = "responses"
"""


@installed(CODEX, "Codex")
def test_codex_exec_finishes_a_turn_and_its_resumed_turn_reads_the_cache(url: str, tmp_path: Path) -> None:
    home = home_for(tmp_path)
    (home / "codex").mkdir()
    (home / "codex" / "config.toml").write_text(CODEX_CONFIG.format(model=MODEL, url=url))
    env = {"CODEX_HOME": str(home / "codex"), "V4SERVE_API_KEY": "sk-unused"}

    def turn(*args: str) -> tuple[list[str], dict[str, int]]:
        events = [json.loads(line) for line in run([CODEX, "exec", "--skip-git-repo-check", "--json", *args],
                                                   home, env).splitlines() if line.startswith("{")]
        said = [e["item"]["text"] for e in events if e.get("item", {}).get("type") == "agent_message"]
        (usage,) = [e["usage"] for e in events if e["type"] == "turn.completed"]
        return said, usage

    said, usage = turn("Say hi")
    assert said == [ANSWER] and usage["input_tokens"] > 1000
    said, usage = turn("resume", "--last", "Again")
    assert said == [ANSWER] and usage["cached_input_tokens"] > 1000


@installed(OPENCODE, "opencode")
def test_opencode_run_finishes_a_turn_and_its_continued_turn_reads_the_cache(url: str, tmp_path: Path) -> None:
    """opencode's own provider for OpenAI-compatible servers (bundled); the model catalogue fetch is off."""
    home = home_for(tmp_path)
    config = home / "config" / "opencode"
    config.mkdir(parents=True)
    (config / "opencode.json").write_text(json.dumps({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"v4serve": {"npm": "@ai-sdk/openai-compatible", "name": "v4serve",
                                 "options": {"baseURL": url + "/v1", "apiKey": "sk-unused"},
                                 "models": {MODEL: {"name": MODEL}}}},
        "model": f"v4serve/{MODEL}"}))
    env = {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"}

    def turn(*args: str) -> tuple[list[str], dict[str, Any]]:
        events = [json.loads(line) for line in run([OPENCODE, "run", "--format", "json", *args], home, env).splitlines()
                  if line.startswith("{")]
        said = [e["part"]["text"] for e in events if e["type"] == "text"]
        (tokens,) = [e["part"]["tokens"] for e in events if e["type"] == "step_finish"]
        return said, tokens

    said, tokens = turn("Say hi")
    assert said == [ANSWER] and tokens["input"] > 1000
    said, tokens = turn("--continue", "Again")
    assert said == [ANSWER] and tokens["cache"]["read"] > 1000


@installed(AIDER, "aider")
def test_aider_answers_about_a_file_and_its_follow_up_shows_a_cache_hit(url: str, tmp_path: Path) -> None:
    """aider puts its history after read-only files, so the follow-up shares the file with the first turn.
    `--no-stream`: streaming, aider counts tokens itself and never reads the server's usage. The other
    flags only stop its update check, analytics prompt and release notes."""
    home = home_for(tmp_path)
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("".join(f"Line {i}: the quick brown fox jumps over the lazy dog.\n"
                                            for i in range(200)))
    args = [AIDER, "--read", "notes.txt", "--model", f"openai/{MODEL}", "--openai-api-base", url + "/v1",
            "--openai-api-key", "sk-unused", "--no-git", "--yes", "--no-stream", "--no-check-update",
            "--analytics-disable", "--no-show-release-notes", "--no-show-model-warnings"]
    first = run([*args, "--message", "Say hi"], home)
    assert ANSWER in first and "cache hit" not in first
    second = run([*args, "--restore-chat-history", "--message", "Again"], home)
    hit = re.search(r"Tokens: \S+ sent, (\S+) cache hit", second)
    assert ANSWER in second and hit and hit.group(1).endswith("k"), second[-500:]
