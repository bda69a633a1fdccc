"""Whole JSON replies written piece by piece (`framing.json_reply`): the text is the JSON of the same
value built whole, a reply that fits in one piece carries its length, a longer one goes out chunked."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from hypothesis import given
from hypothesis import strategies as st

from v4serve.server.framing import BODY_PIECE, Lazy, json_pieces, json_reply

scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text()
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=5), inner, max_size=4), max_leaves=30)


def lazy(value: Any, make_lazy: bool) -> Any:
    """The same value with its lists turned into Lazy arrays (generators, read once) when asked."""
    if isinstance(value, list):
        items = [lazy(v, make_lazy) for v in value]
        return Lazy(iter(items)) if make_lazy else items
    if isinstance(value, dict):
        return {k: lazy(v, make_lazy) for k, v in value.items()}
    return value


@given(values)
def test_pieces_are_the_json_of_the_whole_value(value: Any) -> None:
    text = "".join(json_pieces(lazy(value, True)))
    assert json.loads(text) == json.loads(json.dumps(value))
    assert text == "".join(json_pieces(lazy(value, False)))  # the same text, lazy or not


def body(response: Any) -> tuple[bytes, dict[str, str]]:
    async def read() -> bytes:
        if hasattr(response, "body_iterator"):
            return b"".join([c if isinstance(c, bytes) else c.encode() async for c in response.body_iterator])
        return response.body

    return asyncio.run(read()), dict(response.headers)


def test_a_short_reply_has_its_length_and_a_long_one_is_chunked() -> None:
    short, headers = body(json_reply({"a": Lazy(iter(range(10)))}))
    assert json.loads(short) == {"a": list(range(10))} and headers["content-length"] == str(len(short))
    entries = [{"token": f"t{i}", "logprob": -i / 7} for i in range(BODY_PIECE // 8)]
    reply = {"choices": Lazy(iter([{"logprobs": {"content": Lazy(iter(entries))}}]))}
    long, headers = body(json_reply(reply))
    assert "content-length" not in headers and len(long) > 4 * BODY_PIECE
    assert json.loads(long) == {"choices": [{"logprobs": {"content": entries}}]}
