"""Streaming detokenization for every decoder `tokenizers` ships, checked against `tokenizers` itself.

Real tokenizer.json files are built with the `tokenizers` library (BPE with byte fallback in the
Llama/Mistral layout, Unigram, WordPiece, BPE with an end-of-word suffix, WordLevel, byte-level BPE)
and fitted with each decoder. Ids are streamed one by one through IncrementalDetokenizer and the
chunks, joined, must equal the library's one-shot decode of all ids; no chunk may carry U+FFFD unless
the one-shot text does (half a character is never sent). A WordLevel+Fuse checkpoint must load and
serve a chat completion end to end.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

import httpx
import llguidance
import pytest
from tokenizers import AddedToken, Regex, decoders, models, normalizers, pre_tokenizers, trainers
from tokenizers import Tokenizer as HFBackend

from tests.daemon import PATIENCE, ROOT, daemon
from v4serve.server.text.detokenizer import IncrementalDetokenizer
from v4serve.server.text.tokenizer import (
    ASSISTANT,
    BOS,
    EOS,
    THINK_END,
    THINK_START,
    USER,
    HFTokenizer,
    Tokenizer,
    load_tokenizer,
)

FFFD = "\ufffd"
SP = "\u2581"
SPECIALS = ["<unk>", "<s>", "</s>"]

# ASCII and Latin-1 only: the characters of TEXTS outside it (—, 你好, 🙂, 中文, ...) have no token
# of their own in the byte-fallback vocabulary and are spelled with <0xXX> byte tokens.
CORPUS = [
    "hello world, hello there. the world is wide and the sea is deep",
    "héllo wörld, naïve café: don't stop, it's fine. we're here!",
    "a quick brown fox jumps over the lazy dog 0123456789 (x) [y] {z} \"q\" 'r'",
] * 40
TEXTS = [
    "hello world",
    "héllo wörld — 你好 🙂",
    " leading space and trailing ",
    "two  spaces,  here",
    "don't stop, it's fine. we're here!",
    "emoji 🎉👩\u200d💻 and 中文 mixed with café",
    "x",
    "🙂",
    "",
]
NON_LATIN = "— 你好 🙂 🎉👩\u200d💻 中文"


# --- tokenizer.json builders -------------------------------------------------------------------


def _with_byte_fallback(backend: HFBackend) -> HFBackend:
    """The trained BPE plus the 256 <0xXX> tokens as ordinary vocabulary, byte fallback on."""
    doc = json.loads(backend.to_str())
    vocab = doc["model"]["vocab"]
    for b in range(256):
        vocab.setdefault(f"<0x{b:02X}>", len(vocab))
    doc["model"]["byte_fallback"] = True
    return HFBackend.from_str(json.dumps(doc))


def llama_like() -> HFBackend:
    """BPE with byte fallback, spaces as ▁ through the normalizer, as Llama 2 and Mistral ship it."""
    backend = HFBackend(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend(SP), normalizers.Replace(" ", SP)])
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False)
    backend.train_from_iterator(CORPUS, trainer=trainer)
    return _with_byte_fallback(backend)


def unigram_metaspace() -> HFBackend:
    backend = HFBackend(models.Unigram())
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    trainer = trainers.UnigramTrainer(vocab_size=300, special_tokens=SPECIALS, unk_token="<unk>", show_progress=False)
    backend.train_from_iterator(CORPUS + TEXTS * 5, trainer=trainer)
    return backend


def wordpiece() -> HFBackend:
    backend = HFBackend(models.WordPiece(unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    trainer = trainers.WordPieceTrainer(vocab_size=300, special_tokens=["[UNK]", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(CORPUS + TEXTS * 5, trainer=trainer)
    return backend


def bpe_end_of_word() -> HFBackend:
    backend = HFBackend(models.BPE(unk_token="<unk>", end_of_word_suffix="</w>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIALS, end_of_word_suffix="</w>",
                                  show_progress=False)
    backend.train_from_iterator(CORPUS + TEXTS * 5, trainer=trainer)
    return backend


def word_level() -> HFBackend:
    """Whole words and punctuation runs as tokens; spaces split them and are not tokens."""
    split = pre_tokenizers.Whitespace()
    words = [w for text in CORPUS + TEXTS for w, _ in split.pre_tokenize_str(text)]
    vocab = {t: i for i, t in enumerate(dict.fromkeys([*SPECIALS, *words]))}
    backend = HFBackend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = split
    return backend


def byte_level_bpe() -> HFBackend:
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    backend.train_from_iterator(CORPUS + TEXTS * 5, trainer=trainer)
    return backend


LLAMA_DECODER = decoders.Sequence([decoders.Replace(SP, " "), decoders.ByteFallback(), decoders.Fuse(),
                                   decoders.Strip(" ", 1, 0)])

# name -> (model builder, decoder, whether per-token bytes are exact)
CASES: dict[str, tuple[Callable[[], HFBackend], decoders.Decoder | None, bool]] = {
    "byte_level": (byte_level_bpe, decoders.ByteLevel(), True),
    "sequence_of_byte_level": (byte_level_bpe, decoders.Sequence([decoders.ByteLevel()]), True),
    "byte_level_then_strip": (byte_level_bpe, decoders.Sequence([decoders.ByteLevel(), decoders.Strip(" ", 1, 0)]),
                              False),
    "llama_sequence": (llama_like, LLAMA_DECODER, False),
    "byte_fallback": (llama_like, decoders.ByteFallback(), False),
    "byte_fallback_fuse": (llama_like, decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()]), False),
    "replace": (llama_like, decoders.Replace(SP, " "), False),
    "strip": (llama_like, decoders.Strip(SP, 1, 0), False),
    "fuse_on_bpe": (llama_like, decoders.Fuse(), False),
    "metaspace_on_bpe": (llama_like, decoders.Metaspace(), False),
    "metaspace": (unigram_metaspace, decoders.Metaspace(), False),
    "wordpiece": (wordpiece, decoders.WordPiece(), False),
    "bpe_decoder": (bpe_end_of_word, decoders.BPEDecoder(suffix="</w>"), False),
    "fuse": (word_level, decoders.Fuse(), False),
    "no_decoder": (word_level, None, False),
}


def write_tokenizer(backend: HFBackend, decoder: decoders.Decoder | None, folder: Path) -> Path:
    backend.decoder = decoder
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS[1:]])
    folder.mkdir(parents=True, exist_ok=True)
    backend.save(str(folder / "tokenizer.json"))
    return folder


class Case:
    def __init__(self, name: str, folder: Path) -> None:
        self.name = name
        self.tok = HFTokenizer(folder)
        # The oracle reads the same file on its own: the code under test never answers for it.
        self.oracle = HFBackend.from_file(str(folder / "tokenizer.json"))

    def encode(self, text: str) -> list[int]:
        return self.oracle.encode(text, add_special_tokens=False).ids


@pytest.fixture(scope="module", params=list(CASES))
def case(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Case:
    build, decoder, _ = CASES[request.param]
    return Case(request.param, write_tokenizer(build(), decoder, tmp_path_factory.mktemp(request.param)))


def stream(tok: Tokenizer, ids: Sequence[int], **kwargs: object) -> tuple[list[str], IncrementalDetokenizer]:
    detok = IncrementalDetokenizer(tok, **kwargs)  # type: ignore[arg-type]
    chunks = [detok.push(i) for i in ids]
    chunks.append(detok.flush())
    assert "".join(chunks) == detok.text
    return chunks, detok


def check_against_oracle(case: Case, ids: Sequence[int], skip: bool = True) -> None:
    expected = case.oracle.decode(list(ids), skip_special_tokens=skip)
    chunks, _ = stream(case.tok, ids, skip_special_tokens=skip)
    assert "".join(chunks) == expected, (case.name, ids)
    if FFFD not in expected:
        assert not any(FFFD in c for c in chunks), (case.name, chunks)


# --- the oracle ----------------------------------------------------------------------------------


def test_exactness_flag_follows_the_decoder(case: Case) -> None:
    assert case.tok.exact_token_bytes is CASES[case.name][2]


@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_shot_decode(case: Case, text: str) -> None:
    check_against_oracle(case, case.encode(text))


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens_between_text(case: Case, skip: bool) -> None:
    bos, eos = case.oracle.token_to_id("<s>"), case.oracle.token_to_id("</s>")
    ids = [bos, *case.encode("hello world — 你好"), eos, *case.encode(" 🙂 there"), eos]
    check_against_oracle(case, ids, skip=skip)


def test_random_concatenations_of_encoded_texts(case: Case) -> None:
    rng = random.Random(11)
    pieces = [case.encode(t) for t in [*TEXTS, *NON_LATIN.split(" "), "é", "—", " "]]
    for _ in range(60):
        ids = [i for _ in range(rng.randint(1, 6)) for i in rng.choice(pieces)]
        check_against_oracle(case, ids)


def test_out_of_vocabulary_ids_contribute_nothing(case: Case) -> None:
    # A model's embedding table may be padded past the tokenizer's vocabulary.
    beyond = case.oracle.get_vocab_size(with_added_tokens=True) + 5
    ids = case.encode("hello 你好")
    check_against_oracle(case, [beyond, *ids[:2], beyond, *ids[2:], beyond])


# --- byte fallback splits characters across tokens --------------------------------------------


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Case:
    return Case("llama_sequence", write_tokenizer(llama_like(), LLAMA_DECODER, tmp_path_factory.mktemp("llama")))


def test_byte_fallback_characters_really_span_tokens(llama: Case) -> None:
    ids = llama.encode("你好 🙂")
    pieces = [llama.oracle.id_to_token(i) for i in ids]
    assert sum(p.startswith("<0x") for p in pieces) == len("你好🙂".encode())
    chunks, _ = stream(llama.tok, ids)
    # Each character shows up whole, on the token that completes it, and nowhere before.
    assert [c.strip() for c in chunks if c.strip()] == ["你", "好", "🙂"]


@pytest.mark.parametrize("skip", [True, False])
def test_many_special_tokens_inside_a_split_character(llama: Case, skip: bool) -> None:
    # Skipped specials vanish from the decode, so the bytes around them still form one character;
    # however many there are, that character must not be given up as U+FFFD.
    eos = llama.oracle.token_to_id("</s>")
    first, *rest = llama.encode("你")[-3:]
    ids = [*llama.encode("hello"), first, *[eos] * 40, *rest, *[eos] * 40, *llama.encode(" there")]
    check_against_oracle(llama, ids, skip=skip)


def test_garbage_bytes_are_released_before_the_end(llama: Case) -> None:
    # Lone continuation bytes never become a character; they may not hold the stream back forever.
    cont = llama.oracle.token_to_id("<0x80>")
    ids = [*llama.encode("hello"), *[cont] * 50, *llama.encode(" there")]
    chunks, detok = stream(llama.tok, ids)
    assert detok.text == llama.oracle.decode(ids)
    assert FFFD in "".join(chunks[: 5 + 40])


def test_leading_space_kept_mid_text_and_dropped_at_start(llama: Case) -> None:
    ids = llama.encode("hello world")
    assert [llama.oracle.id_to_token(i)[:1] for i in ids].count(SP) == 2  # both words carry their ▁
    chunks, detok = stream(llama.tok, ids)
    assert detok.text == "hello world"
    assert not chunks[0].startswith(" ") and any(c.startswith(" w") for c in chunks)


def test_grammar_engine_sees_llama_pieces_as_mid_text_bytes(llama: Case) -> None:
    grammar_tok = llguidance.LLTokenizer(llama.tok.vocabulary_json(), n_vocab=1024, eos_token=0)
    assert grammar_tok.decode_bytes(llama.encode("hello world — 你好")) == " hello world — 你好".encode()


def test_token_bytes_are_mid_text_pieces(llama: Case) -> None:
    world = llama.oracle.token_to_id(f"{SP}world")
    assert world is not None
    assert llama.tok.token_bytes(world) == b" world"
    assert llama.tok.token_bytes(llama.oracle.token_to_id("<0xE4>")) == b"\xe4"
    assert llama.tok.token_bytes(llama.oracle.token_to_id("</s>")) == b"</s>"
    assert llama.tok.token_bytes(llama.oracle.token_to_id("</s>"), skip_special_tokens=True) == b""


# --- stop strings, min_tokens, include_stop_str_in_output on the general path ----------------


def reference(text: str, stops: Sequence[str], include: bool) -> tuple[str, str | None]:
    found = [(text.find(s) + len(s), text.find(s), s) for s in stops if s in text]
    if not found:
        return text, None
    end, start, stop = min(found)
    return text[: end if include else start], stop


STOP_CASES = [
    ("hello world — 你好 🙂 and more", ["你好"]),
    ("hello world — 你好 🙂 and more", ["🙂"]),
    ("hello world, hello there", ["lo th", "zzz"]),
    ("héllo wörld — naïve", ["wör"]),
    ("don't stop, it's fine.", ["stop,", "it's"]),
    ("hello world", ["nothing matches"]),
]


@pytest.mark.parametrize(("text", "stops"), STOP_CASES)
@pytest.mark.parametrize("include", [False, True])
def test_stop_strings_on_general_path(llama: Case, text: str, stops: list[str], include: bool) -> None:
    ids = llama.encode(text)
    full = llama.oracle.decode(ids)
    expected, stop = reference(full, stops, include)
    chunks, detok = stream(llama.tok, ids, stop=stops, include_stop_str_in_output=include)
    assert detok.text == expected
    assert detok.stop_reason == stop
    if stop is not None:
        # Nothing that later turned out to be (part of) the stop string was sent early.
        assert "".join(chunks) == expected


def test_held_tail_released_when_it_stops_being_a_stop_prefix(llama: Case) -> None:
    ids = llama.encode("hello world")
    detok = IncrementalDetokenizer(llama.tok, stop=["world peace"])
    sent = "".join(detok.push(i) for i in ids)
    assert sent == "hello "  # "world" could still become "world peace"
    assert detok.flush() == "world"


def test_min_tokens_on_general_path(llama: Case) -> None:
    ids = llama.encode("stop here, stop there")
    full = llama.oracle.decode(ids)
    # The first "stop" is spoken within the first min_tokens tokens and cannot end the text.
    first_stop_tokens = next(k for k in range(1, len(ids) + 1) if "stop" in llama.oracle.decode(ids[:k]))
    _, detok = stream(llama.tok, ids, stop=["stop"], min_tokens=first_stop_tokens)
    assert detok.text == full[: full.index("stop", full.index("stop") + 1)]
    _, plain = stream(llama.tok, ids, stop=["stop"])
    assert plain.text == ""


# --- the grammar engine's view of a non-byte-level vocabulary -------------------------------


def test_grammar_engine_reads_the_vocabulary(case: Case) -> None:
    size = case.oracle.get_vocab_size(with_added_tokens=True)
    grammar_tok = llguidance.LLTokenizer(case.tok.vocabulary_json(), n_vocab=size + 8, eos_token=0)
    # llguidance marks special tokens with a leading 0xFF byte, so a token that is just that byte
    # reads back empty whatever the document says.
    specials = case.tok.special_token_ids
    ordinary = [i for i in range(size) if i not in specials and case.tok.token_bytes(i)[:1] != b"\xff"]
    owners: dict[bytes, list[int]] = {}
    for i in ordinary:
        owners.setdefault(case.tok.token_bytes(i), []).append(i)
    for i in ordinary:
        seen = grammar_tok.decode_bytes([i])
        if seen != case.tok.token_bytes(i):
            # A token whose bytes are empty or another token's cannot be spelled in the byte-level
            # twin; the grammar engine then knows it as bytes-less (shown as <[id]>) and never allows it.
            assert seen == f"<[{i}]>".encode(), (case.name, i, seen)
            assert case.tok.token_bytes(i) == b"" or len(owners[case.tok.token_bytes(i)]) > 1


# --- end to end: a WordLevel + Fuse checkpoint serves ---------------------------------------


def chat_word_level(folder: Path) -> int:
    """A WordLevel+Fuse tokenizer.json with DeepSeek's prompt tokens; returns its vocabulary size."""
    split = pre_tokenizers.Whitespace()
    chat = [BOS, EOS, USER, ASSISTANT, THINK_START, THINK_END]
    words = [w for text in CORPUS + TEXTS for w, _ in split.pre_tokenize_str(text)]
    vocab = {t: i for i, t in enumerate(dict.fromkeys([*chat, "<unk>", *words]))}
    backend = HFBackend(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex(r"\s+"), "removed"), split])
    backend.decoder = decoders.Fuse()
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in chat])
    backend.save(str(folder / "tokenizer.json"))
    return backend.get_vocab_size(with_added_tokens=True)


@pytest.fixture(scope="module")
def fuse_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("fuse-model") / "ckpt"
    size = chat_word_level(tmp_path_factory.mktemp("fuse-tokenizer"))
    done = subprocess.run([sys.executable, "-m", "v4serve.server.cli", "make-checkpoint", str(folder),
                           "--set", f"vocab_size={size}"], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    chat_word_level(folder)  # replaces the byte tokenizer make-checkpoint wrote
    return folder


def test_word_level_fuse_checkpoint_loads(fuse_checkpoint: Path) -> None:
    tok = load_tokenizer(fuse_checkpoint)
    assert isinstance(tok, HFTokenizer) and not tok.exact_token_bytes
    assert tok.decode(tok.encode("hello world")) == "helloworld"


def test_word_level_fuse_checkpoint_serves_chat(fuse_checkpoint: Path) -> None:
    body = {"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 12, "temperature": 0,
            "ignore_eos": True}
    with daemon("--model", str(fuse_checkpoint), "--default-chat-template-kwargs", '{"thinking": false}') as url:
        reply = httpx.post(url + "/v1/chat/completions", json=body, timeout=PATIENCE)
        assert reply.status_code == 200, reply.text
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "stream": True}, timeout=PATIENCE) as s:
            lines = [line[6:] for line in s.iter_lines() if line.startswith("data: ") and line != "data: [DONE]"]
    answer = reply.json()
    assert answer["usage"]["completion_tokens"] == 12
    message = answer["choices"][0]["message"]
    assert message["content"]  # the random model's ids are words of this vocabulary
    streamed = "".join(c["choices"][0]["delta"].get("content") or "" for c in map(json.loads, lines) if c["choices"])
    assert streamed == (message["content"] or "")
