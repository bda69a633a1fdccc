"""Streaming detokenizer tests: whole UTF-8 characters only, stop strings, hold-back and flush."""

from __future__ import annotations

import random
from collections.abc import Sequence
from itertools import pairwise
from pathlib import Path

import pytest

from v4serve.engine.process.client import TokenOutput
from v4serve.engine.request import Sample
from v4serve.server.text.detokenizer import IncrementalDetokenizer
from v4serve.server.text.output import ChoiceText, OutputOptions
from v4serve.server.text.tokenizer import BYTE_OFFSET, ByteTokenizer, HFTokenizer, write_byte_tokenizer_files

BAR = "\uff5c"
SP = "\u2581"
BOS = f"<{BAR}begin{SP}of{SP}sentence{BAR}>"
EOS = f"<{BAR}end{SP}of{SP}sentence{BAR}>"
BOS_ID = 0
EOS_ID = 1
FFFD = "\ufffd"


class PieceTokenizer:
    """Test double whose tokens are arbitrary byte strings, for stops inside one multi-character token."""

    exact_token_bytes = True

    def __init__(self, pieces: Sequence[bytes], special_ids: Sequence[int] = ()) -> None:
        self.pieces = list(pieces)
        self.special_token_ids = frozenset(special_ids)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        if skip_special_tokens and token_id in self.special_token_ids:
            return b""
        return self.pieces[token_id]


@pytest.fixture(scope="module")
def hf_tok(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    directory: Path = tmp_path_factory.mktemp("byte_tokenizer")
    write_byte_tokenizer_files(directory)
    return HFTokenizer(directory)


@pytest.fixture(params=["byte", "hf"])
def tok(request: pytest.FixtureRequest, hf_tok: HFTokenizer) -> ByteTokenizer | HFTokenizer:
    return ByteTokenizer() if request.param == "byte" else hf_tok


def byte_ids(data: bytes) -> list[int]:
    return [BYTE_OFFSET + b for b in data]


def run(detok: IncrementalDetokenizer, ids: Sequence[int]) -> list[str]:
    """Push every id then flush; return each call's output (flush last) and check they add up to .text."""
    chunks = [detok.push(i) for i in ids]
    chunks.append(detok.flush())
    assert "".join(chunks) == detok.text
    return chunks


def stream_text(tok: object, text: str, **kwargs: object) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    return run(detok, byte_ids(text.encode("utf-8"))), detok


def reference(data: bytes, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    """Non-streaming answer: full decode, cut at the stop string that is complete first."""
    text = data.decode("utf-8", errors="replace")
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s and s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


# --- UTF-8 ---------------------------------------------------------------------------------------

MULTIBYTE = ["é", "中", "🎉", "👩\u200d💻", "👩\u200d👩\u200d👧\u200d👦", "🇫🇷", "naïve café — 中文 🎉 👩\u200d💻!"]


@pytest.mark.parametrize("text", MULTIBYTE)
def test_multibyte_characters_never_emitted_partially(tok: ByteTokenizer | HFTokenizer, text: str) -> None:
    data = text.encode("utf-8")
    detok = IncrementalDetokenizer(tok)
    for k, token in enumerate(byte_ids(data), start=1):
        chunk = detok.push(token)
        assert FFFD not in chunk
        # Exactly the complete characters among the first k bytes, nothing more, nothing less.
        assert detok.text == data[:k].decode("utf-8", errors="ignore")
    assert detok.flush() == ""
    assert detok.text == text


def test_four_byte_character_appears_only_on_its_last_byte() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    chunks = [detok.push(i) for i in byte_ids("🎉".encode())]
    assert chunks == ["", "", "", "🎉"]


def test_zwj_sequence_is_emitted_code_point_by_code_point() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    chunks = [c for c in run(detok, byte_ids("👩\u200d💻".encode())) if c]
    assert chunks == ["👩", "\u200d", "💻"]


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (b"\xff", [FFFD]),
        (b"a\xffb", ["a", FFFD, "b"]),
        (b"\xc3A", ["", f"{FFFD}A"]),
        (b"\xf0\x9fA", ["", "", f"{FFFD}A"]),
        (b"\x80\x80", [FFFD, FFFD]),
        # An encoded surrogate is rejected once its last byte is in: late, but never stuck.
        (b"\xed\xa0\x80", ["", "", FFFD * 3]),
        (b"\xed\xa0A", ["", "", f"{FFFD * 2}A"]),
    ],
)
def test_invalid_bytes_become_replacement_without_blocking(data: bytes, expected: list[str]) -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    assert [detok.push(i) for i in byte_ids(data)] == expected
    assert detok.flush() == ""
    assert detok.text == data.decode("utf-8", errors="replace")


@pytest.mark.parametrize("data", [b"ok\xe4\xb8", b"\xf0\x9f\x8e", b"\xc3"])
def test_flush_turns_incomplete_tail_into_replacement(tok: ByteTokenizer | HFTokenizer, data: bytes) -> None:
    detok = IncrementalDetokenizer(tok)
    chunks = run(detok, byte_ids(data))
    assert FFFD not in "".join(chunks[:-1])
    assert chunks[-1] == FFFD
    assert detok.text == data.decode("utf-8", errors="replace")


def test_random_bytes_match_full_decode(tok: ByteTokenizer | HFTokenizer) -> None:
    rng = random.Random(1234)
    pool = [b"a", b" ", "é".encode(), "中".encode(), "🎉".encode(), b"\xff", b"\xc3", b"\xe4\xb8", b"\x80", b"\xf0\x9f"]
    for _ in range(300):
        data = b"".join(rng.choice(pool) for _ in range(rng.randint(0, 12)))
        detok = IncrementalDetokenizer(tok)
        run(detok, byte_ids(data))
        assert detok.text == data.decode("utf-8", errors="replace") == tok.decode(byte_ids(data))


# --- special tokens ------------------------------------------------------------------------------


def test_special_tokens_skipped_by_default(tok: ByteTokenizer | HFTokenizer) -> None:
    ids = [BOS_ID, *byte_ids(b"hi"), EOS_ID]
    detok = IncrementalDetokenizer(tok)
    assert run(detok, ids) == ["", "h", "i", "", ""]
    assert detok.text == "hi" == tok.decode(ids, skip_special_tokens=True)


def test_special_tokens_kept_when_asked(tok: ByteTokenizer | HFTokenizer) -> None:
    ids = [BOS_ID, *byte_ids(b"hi"), EOS_ID]
    detok = IncrementalDetokenizer(tok, skip_special_tokens=False)
    assert run(detok, ids) == [BOS, "h", "i", EOS, ""]
    assert detok.text == f"{BOS}hi{EOS}" == tok.decode(ids, skip_special_tokens=False)


def test_skipped_special_does_not_break_a_character_around_it() -> None:
    ids = [BYTE_OFFSET + 0xC3, BOS_ID, BYTE_OFFSET + 0xA9]
    skipping = IncrementalDetokenizer(ByteTokenizer())
    keeping = IncrementalDetokenizer(ByteTokenizer(), skip_special_tokens=False)
    run(skipping, ids)
    run(keeping, ids)
    assert skipping.text == "é"
    assert keeping.text == f"{FFFD}{BOS}{FFFD}"


# --- stop strings --------------------------------------------------------------------------------


def test_stop_spanning_tokens(tok: ByteTokenizer | HFTokenizer) -> None:
    chunks, detok = stream_text(tok, "hello world", stop=["o w"])
    assert detok.text == "hell"
    assert detok.stopped
    assert detok.stop_reason == "o w"
    assert chunks[-1] == ""


def test_stop_inside_one_token_drops_rest_of_token() -> None:
    tok = PieceTokenizer([b"x", b"aSTOPb", b"more"])
    detok = IncrementalDetokenizer(tok, stop=["STOP"])
    assert run(detok, [0, 1, 2]) == ["x", "a", "", ""]
    assert detok.stop_reason == "STOP"
    assert detok.text == "xa"


def test_stop_inside_special_token_kept_as_text(tok: ByteTokenizer | HFTokenizer) -> None:
    ids = [*byte_ids(b"ab"), BOS_ID, *byte_ids(b"cd")]
    plain = IncrementalDetokenizer(tok, skip_special_tokens=False, stop=["begin"])
    inclusive = IncrementalDetokenizer(tok, skip_special_tokens=False, stop=["begin"], include_stop_str_in_output=True)
    run(plain, ids)
    run(inclusive, ids)
    assert plain.text == f"ab<{BAR}"
    assert inclusive.text == f"ab<{BAR}begin"
    # Skipped specials contribute no text, so they cannot match.
    skipped = IncrementalDetokenizer(tok, stop=["begin"])
    run(skipped, ids)
    assert (skipped.text, skipped.stopped) == ("abcd", False)


def choice_text(tok: ByteTokenizer | HFTokenizer, ids: Sequence[int], stop: tuple[str, ...]) -> tuple[str, str | None]:
    """A choice's content as a client receives it, one token per output as a stream gets them, and its finish."""
    choice = ChoiceText(tok, OutputOptions(stop=stop))
    deltas = [choice.push(TokenOutput(0, (t,), (Sample(t, 0.0, []),))) for t in ids if not choice.finished]
    if not choice.finished:
        deltas.append(choice.push(TokenOutput(0, finished=True, finish_reason="length")))
    return "".join(d.text for d in deltas), deltas[-1].finish_reason


def test_stop_at_very_start(tok: ByteTokenizer | HFTokenizer) -> None:
    chunks, detok = stream_text(tok, "STOP and then", stop=["STOP"])
    assert chunks == [""] * 14
    assert detok.text == ""
    assert detok.stop_reason == "STOP"


def test_overlapping_candidate_ab_in_aab(tok: ByteTokenizer | HFTokenizer) -> None:
    chunks, detok = stream_text(tok, "aab", stop=["ab"])
    # The first "a" is released once the second "a" shows it cannot begin "ab".
    assert chunks == ["", "a", "", ""]
    assert detok.text == "a"
    assert detok.stop_reason == "ab"


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [("aaab", "aab", "a"), ("ababac", "abac", "ab"), ("abababx", "ababx", "ab"), ("xxabcabd", "abd", "xxabc")],
)
def test_self_overlapping_stops(tok: ByteTokenizer | HFTokenizer, text: str, stop: str, expected: str) -> None:
    _, detok = stream_text(tok, text, stop=[stop])
    assert detok.text == expected
    assert detok.stop_reason == stop


@pytest.mark.parametrize("stops", [["world", "lo"], ["lo", "world"]])
def test_several_stops_earliest_wins(tok: ByteTokenizer | HFTokenizer, stops: list[str]) -> None:
    _, detok = stream_text(tok, "hello world", stop=stops)
    assert detok.text == "hel"
    assert detok.stop_reason == "lo"


@pytest.mark.parametrize("pieces", [[b"abcdef"], [b"a", b"b", b"c", b"d", b"e", b"f"], [b"ab", b"cdef"]])
def test_stop_completed_first_wins_however_text_is_split(pieces: list[bytes]) -> None:
    # "bcd" is complete one character before "abcde", even though "abcde" starts earlier.
    detok = IncrementalDetokenizer(PieceTokenizer(pieces), stop=["abcde", "bcd"])
    run(detok, range(len(pieces)))
    assert (detok.text, detok.stop_reason) == ("a", "bcd")


def test_stops_completing_together_prefer_earlier_start() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["b", "ab"])
    run(detok, byte_ids(b"xab"))
    assert (detok.text, detok.stop_reason) == ("x", "ab")


def test_include_stop_str_in_output(tok: ByteTokenizer | HFTokenizer) -> None:
    chunks, detok = stream_text(tok, "hello world and more", stop=["world"], include_stop_str_in_output=True)
    assert detok.text == "hello world"
    assert "".join(chunks) == "hello world"
    assert detok.stop_reason == "world"


def test_held_prefix_released_when_it_is_not_a_stop(tok: ByteTokenizer | HFTokenizer) -> None:
    chunks, detok = stream_text(tok, "hello worm", stop=["world"])
    assert chunks == ["h", "e", "l", "l", "o", " ", "", "", "", "worm", ""]
    assert detok.text == "hello worm"
    assert not detok.stopped
    assert detok.stop_reason is None


def test_flush_releases_held_stop_prefix_as_text(tok: ByteTokenizer | HFTokenizer) -> None:
    chunks, detok = stream_text(tok, "hello wor", stop=["world"])
    assert chunks[-1] == "wor"
    assert detok.text == "hello wor"
    assert not detok.stopped


def test_stop_can_complete_with_replacement_character_at_flush() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=[f"x{FFFD}"])
    chunks = run(detok, byte_ids(b"ax\xe4\xb8"))
    assert chunks == ["a", "", "", "", ""]
    assert detok.stop_reason == f"x{FFFD}"


def test_tokens_after_stop_are_ignored() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["!"])
    assert [detok.push(i) for i in byte_ids(b"hi!there")] == ["h", "i", "", "", "", "", "", ""]
    assert detok.flush() == ""
    assert detok.flush() == ""
    assert detok.text == "hi"


def test_push_after_flush_is_an_error() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer())
    detok.flush()
    with pytest.raises(RuntimeError):
        detok.push(BYTE_OFFSET + ord("a"))


def test_bare_string_is_one_stop_and_empty_stops_are_ignored() -> None:
    _, bare = stream_text(ByteTokenizer(), "hello world", stop="wor")
    _, empty = stream_text(ByteTokenizer(), "hello world", stop=["", ""])
    assert (bare.text, bare.stop_reason) == ("hello ", "wor")
    assert (empty.text, empty.stopped) == ("hello world", False)


def test_hold_back_never_exceeds_longest_stop_minus_one() -> None:
    stops = ["aaaaa", "ab"]
    text = "a" * 50 + "b"
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=stops)
    for k, token in enumerate(byte_ids(text.encode()), start=1):
        detok.push(token)
        if not detok.stopped:
            assert k - len(detok.text) <= 4
    assert detok.stop_reason == "aaaaa"
    assert detok.text == ""


def test_hold_back_stays_small_over_long_output() -> None:
    detok = IncrementalDetokenizer(ByteTokenizer(), stop=["</answer>"])
    text = "the answer is <b>forty two</b> " * 400
    for k, token in enumerate(byte_ids(text.encode()), start=1):
        detok.push(token)
        assert k - len(detok.text) <= len("</answer>") - 1
    assert detok.flush() == ""
    assert detok.text == text


# --- properties over random inputs ---------------------------------------------------------------


def random_case(rng: random.Random) -> tuple[bytes, list[str]]:
    alphabet = ["a", "b", "c", "é", "中", "🎉"]
    text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 24)))
    data = text.encode("utf-8")
    if rng.random() < 0.3:
        cut = rng.randint(0, len(data))
        data = data[:cut] + rng.choice([b"\xff", b"\xc3", b"\xe4\xb8"]) + data[cut:]
    stops = ["".join(rng.choice(alphabet[:4]) for _ in range(rng.randint(1, 4))) for _ in range(rng.randint(0, 3))]
    return data, stops


def random_split(rng: random.Random, data: bytes) -> list[bytes]:
    cuts = sorted(rng.sample(range(1, len(data)), k=rng.randint(0, max(0, len(data) - 1)))) if len(data) > 1 else []
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in pairwise(bounds) if b > a]


@pytest.mark.parametrize("include", [False, True])
def test_streaming_matches_non_streaming_for_any_split(include: bool) -> None:
    rng = random.Random(99 + include)
    for _ in range(500):
        data, stops = random_case(rng)
        expected, reason = reference(data, stops, include)
        pieces = random_split(rng, data)
        for tok, ids in ((ByteTokenizer(), byte_ids(data)), (PieceTokenizer(pieces), list(range(len(pieces))))):
            detok = IncrementalDetokenizer(tok, stop=stops, include_stop_str_in_output=include)  # type: ignore[arg-type]
            for i in ids:
                detok.push(i)
                # Whatever was sent must survive as the start of the final answer.
                assert expected.startswith(detok.text), (data, stops)
            detok.flush()
            assert (detok.text, detok.stop_reason) == (expected, reason), (data, stops, pieces)


def test_hf_twin_streams_identically(hf_tok: HFTokenizer) -> None:
    rng = random.Random(7)
    for _ in range(200):
        data, stops = random_case(rng)
        ids = byte_ids(data)
        if rng.random() < 0.5:
            ids.insert(rng.randint(0, len(ids)), rng.choice([BOS_ID, EOS_ID, 5]))
        skip = rng.random() < 0.5
        outputs = []
        for tok in (ByteTokenizer(), hf_tok):
            detok = IncrementalDetokenizer(tok, skip_special_tokens=skip, stop=stops)
            outputs.append((run(detok, ids), detok.stop_reason))
        assert outputs[0] == outputs[1]
