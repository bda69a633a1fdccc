"""The DSML tool-call parser on strings written from DeepSeek-V4's documented format (spelled out
here, not produced by the code under test), whole and split at every possible point."""

from __future__ import annotations

import json
import random

import pytest

from v4serve.server.text.tool_calls import ToolCallDelta, ToolCallParser

D = "\uff5cDSML\uff5c"  # ｜DSML｜


def block(*invokes: str) -> str:
    return f"\n\n<{D}tool_calls>\n" + "\n".join(invokes) + f"\n</{D}tool_calls>"


def invoke(name: str, *params: tuple[str, bool, str]) -> str:
    body = "\n".join(f'<{D}parameter name="{p}" string="{"true" if s else "false"}">{v}</{D}parameter>'
                     for p, s, v in params)
    return f'<{D}invoke name="{name}">\n{body}\n</{D}invoke>'


def parse(text: str, pieces: list[str] | None = None, parallel: bool = True, cut_off: bool = False
          ) -> tuple[str, list[dict], ToolCallParser]:
    parser = ToolCallParser(parallel)
    content, deltas = "", []
    for piece in pieces if pieces is not None else [text]:
        c, d = parser.push(piece)
        content, deltas = content + c, deltas + d
    c, d = parser.finish(cut_off)
    return content + c, assemble(content + c, deltas + d), parser


def assemble(_: str, deltas: list[ToolCallDelta]) -> list[dict]:
    calls: dict[int, dict] = {}
    for d in deltas:
        call = calls.setdefault(d.index, {"id": d.id, "name": d.name, "arguments": ""})
        call["arguments"] += d.arguments
    return [calls[i] for i in sorted(calls)]


def splits(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), k=min(len(text) - 1, rng.randint(1, 12))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]


CASES = {
    "one call": (block(invoke("get_weather", ("city", True, "Paris"), ("days", False, "3"))), "",
                 [("get_weather", {"city": "Paris", "days": 3})]),
    "text before a call": ("Let me check." + block(invoke("lookup", ("q", True, "x"))), "Let me check.",
                           [("lookup", {"q": "x"})]),
    "parallel calls": (block(invoke("a", ("n", False, "1")), invoke("b", ("n", False, "2")), invoke("c")), "",
                       [("a", {"n": 1}), ("b", {"n": 2}), ("c", {})]),
    "nested JSON and escaped quotes": (
        block(invoke("f", ("cfg", False, '{"a":[1,{"b":"x\\"y"}],"c":null}'), ("s", True, 'say "hi" \\ <tag>\n2'))),
        "", [("f", {"cfg": {"a": [1, {"b": 'x"y'}], "c": None}, "s": 'say "hi" \\ <tag>\n2'})]),
    "unicode and markup-like text": (block(invoke("f", ("s", True, "Zürich 北京 </not-a-tag>"))), "",
                                     [("f", {"s": "Zürich 北京 </not-a-tag>"})]),
    "no call at all": ("plain text with a < and ｜ in it\n\n", "plain text with a < and ｜ in it\n\n", []),
}


@pytest.mark.parametrize("case", list(CASES))
def test_calls_and_content_whole_and_split(case: str) -> None:
    text, want_content, want_calls = CASES[case]
    rng = random.Random(case)
    for pieces in [None, list(text), *(splits(text, rng) for _ in range(30))]:
        content, calls, parser = parse(text, pieces)
        assert content == want_content, pieces
        assert [(c["name"], json.loads(c["arguments"])) for c in calls] == want_calls
        assert all(c["id"] and c["id"].startswith("call_") for c in calls)
        assert not parser.truncated and D not in content


def test_arguments_are_the_same_string_however_the_text_arrives() -> None:
    text = CASES["nested JSON and escaped quotes"][0]
    whole = parse(text)[1][0]["arguments"]
    rng = random.Random(3)
    assert all(parse(text, splits(text, rng))[1][0]["arguments"] == whole for _ in range(50))


def test_a_call_cut_off_anywhere_is_a_call_so_far_and_never_markup() -> None:
    """Cut at every character of a call (by the token limit): once markup has begun the content is the text
    before it (its line breaks dropped), before that all of it; once the invoke tag is whole the call is there,
    its arguments a prefix of the whole call's, growing with the cut; before it there is no call."""
    full = "Checking." + block(invoke("get_weather", ("city", True, "Paris"), ("days", False, "3")))
    named = full.index(f'<{D}invoke name="get_weather">') + len(f'<{D}invoke name="get_weather">')
    whole = '{"city": "Paris", "days": 3}'
    opened = full.index(f"<{D}tool_calls>") + len(f"<{D}")
    so_far = ""
    for cut in range(len("Checking."), len(full)):
        content, calls, parser = parse(full[:cut], list(full[:cut]) if cut % 7 == 0 else None, cut_off=True)
        assert content == ("Checking." if cut >= opened else full[:cut]), cut
        assert parser.truncated == (cut >= opened), cut
        if cut < named:
            assert calls == [], cut
            continue
        assert [c["name"] for c in calls] == ["get_weather"], cut
        assert whole.startswith(calls[0]["arguments"]) and calls[0]["arguments"].startswith(so_far), cut
        so_far = calls[0]["arguments"]
    assert so_far == whole
    assert parse(full)[0] == "Checking." and not parse(full)[2].truncated


def test_text_ending_in_line_breaks_keeps_them() -> None:
    assert parse("two lines\n\n")[0] == "two lines\n\n" and parse("x\n")[0] == "x\n"
    assert parse("x\n\n<")[0] == "x\n\n<"  # no DSML began
    assert parse(f"x\n\n<{D}")[0] == "x"  # a block began and was cut off
    # Cut off by the token limit, text that began no markup is text still, as DeepSeek's parser keeps it.
    assert parse("x\n\n", cut_off=True)[0] == "x\n\n" and parse("x\n\n<", cut_off=True)[0] == "x\n\n<"


def test_only_the_first_call_without_parallel_calls() -> None:
    text = block(invoke("a", ("n", False, "1")), invoke("b", ("n", False, "2")))
    _, calls, _ = parse(text, parallel=False)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("a", {"n": 1})]


def test_once_markup_begins_only_its_calls_count_as_deepseeks_parser_reads_it() -> None:
    content, calls, _ = parse(f"see <{D}tool_calls> here")  # the tag, then no invoke: no call, and no more text
    assert calls == [] and content == "see "
    content, calls, _ = parse(block(f"<{D}invoke oops>"))
    assert calls == [] and content == ""
    text = f"a <{D}foo> b\n" + invoke("f", ("n", False, "1")) + "junk" + f"</{D}tool_calls> after" + block(invoke("g"))
    content, calls, _ = parse(text)  # an unknown tag skipped, the invoke read, nothing after the close
    assert content == "a " and [(c["name"], json.loads(c["arguments"])) for c in calls] == [("f", {"n": 1})]
    content, calls, _ = parse(f"a {D} b")  # the marker opening no tag is text
    assert content == f"a {D} b" and calls == []
