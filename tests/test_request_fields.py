"""Nothing silently ignored: every field of every request model is either used by the server's code
or marked accepted-and-ignored and listed, with its reason, in the README (unknown fields: test_field_policy.py)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from v4serve.server.messages import (
    AnthropicMessage,
    AnthropicTool,
    AnthropicToolChoice,
    ClearThinking,
    ContextManagement,
    CountTokensRequest,
    ImageBlock,
    ImageSource,
    MessagesRequest,
    OutputConfig,
    OutputFormat,
    TextBlock,
    ThinkingBlock,
    ThinkingConfig,
    ToolResultBlock,
    ToolUseBlock,
)
from v4serve.server.protocol import (
    IGNORED,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    StreamOptions,
    TokenizeRequest,
)
from v4serve.server.responses import (
    ContentPart,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    MessageItem,
    ReasoningConfig,
    ReasoningItem,
    ResponsesRequest,
    TextConfig,
    TextFormat,
)

ROOT = Path(__file__).resolve().parents[1]
MODELS: list[type[BaseModel]] = [ChatCompletionRequest, CompletionRequest, ChatMessage, StreamOptions,
                                 TokenizeRequest, DetokenizeRequest,
                                 MessagesRequest, CountTokensRequest, AnthropicMessage, AnthropicTool,
                                 AnthropicToolChoice, ThinkingConfig, OutputConfig, OutputFormat, TextBlock,
                                 ToolUseBlock, ToolResultBlock, ThinkingBlock, ClearThinking, ContextManagement,
                                 ImageBlock, ImageSource,
                                 ResponsesRequest, ContentPart, MessageItem, FunctionCallItem, FunctionCallOutputItem,
                                 ReasoningItem, FunctionTool, TextFormat, TextConfig, ReasoningConfig]
SOURCE = "\n".join(p.read_text() for folder in ("server", "engine") for p in (ROOT / folder).rglob("*.py")
                   if p.name not in ("protocol.py", "messages.py", "responses.py"))
# In the models' own module only a validator's or method's use counts (`self.field`), not the definition;
# a field validator handles the fields it names too (e.g. one that refuses all but the value v4serve honours).
PROTOCOL = (ROOT / "server" / "protocol.py").read_text()
SOURCE += "\n".join(re.findall(r"self\.\w+", PROTOCOL))
SOURCE += "\n".join(re.findall(r"field_validator\(([^)]*)\)", PROTOCOL))
# The Messages and Responses APIs' models share their modules with the code that reads them: only uses count there.
MESSAGES = (ROOT / "server" / "messages.py").read_text() + (ROOT / "server" / "responses.py").read_text()
SOURCE += "\n".join(re.findall(r"\w+(?:\.\w+)+|[\"']\w+[\"']", MESSAGES))
README = (ROOT / "README.md").read_text()
IGNORED_TABLE = README[README.index("| field | why it is ignored |"):].split("\n\n", 1)[0]


def readme_name(model: type[BaseModel], field: str) -> str:
    return f"`messages[].{field}`" if model is ChatMessage else f"`{field}`"


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_every_field_is_handled_or_listed_as_ignored(model: type[BaseModel]) -> None:
    for name, info in model.model_fields.items():
        if IGNORED in (info.json_schema_extra or {}):
            assert readme_name(model, name) in IGNORED_TABLE, f"{model.__name__}.{name}: ignored, not in the README"
        else:
            used = re.search(rf"\.{name}\b|[\"']{name}[\"']", SOURCE)
            assert used, f"{model.__name__}.{name} is neither used by the server nor listed as ignored"


def test_the_readme_lists_only_fields_that_are_ignored() -> None:
    first_column = [row.split("|")[1] for row in IGNORED_TABLE.splitlines()[2:]]
    listed = {name for cell in first_column for name in re.findall(r"`(?:messages\[\]\.)?(\w+)`", cell)}
    ignored = {name for model in MODELS for name, info in model.model_fields.items()
               if IGNORED in (info.json_schema_extra or {})}
    assert listed == ignored
