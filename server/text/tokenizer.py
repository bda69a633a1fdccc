"""Tokenizers for v4serve.

Two implementations share one small interface (:class:`Tokenizer`):

- :class:`ByteTokenizer`, the embedded tiny model's tokenizer: 64 special tokens followed by the
  256 raw bytes, so any text round-trips and the tiny model can be built without any files;
- :class:`HFTokenizer`, a ``tokenizer.json`` read through the ``tokenizers`` library (the real
  DeepSeek-V4 checkpoints ship one).

:func:`write_byte_tokenizer_files` writes the byte tokenizer as a genuine ``tokenizer.json`` so a
checkpoint folder made from the tiny model loads through the same path as a real one and
tokenizes identically.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from tokenizers import AddedToken, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as _HFBackend

# DeepSeek-V4's special-token strings: the one place they are spelled (chat encoding uses these).
BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
THINK_START = "<think>"
THINK_END = "</think>"
DSML = "｜DSML｜"
LATEST_REMINDER = "<｜latest_reminder｜>"
SYSTEM = "<｜System｜>"  # V4.1's system marker
IMAGE = "<｜image｜>"  # an image placeholder
# Ids a prompt holds but the model never writes: the sampler never draws them.
INPUT_ONLY_SPECIALS = (BOS, PAD, USER, ASSISTANT, LATEST_REMINDER, SYSTEM, IMAGE)

# The prompt-format tokens of DeepSeek-V4 (then V4.1's two), in the order they get ids in the byte tokenizer.
# BOS/EOS/PAD sit at 0/1/2 as in the real vocabulary; the rest are packed after them.
_NAMED_SPECIALS: tuple[str, ...] = (
    BOS,
    EOS,
    PAD,
    USER,
    ASSISTANT,
    THINK_START,
    THINK_END,
    DSML,
    LATEST_REMINDER,
    "<｜action｜>",
    "<｜query｜>",
    "<｜authority｜>",
    "<｜domain｜>",
    "<｜title｜>",
    "<｜read_url｜>",
    SYSTEM,
    IMAGE,
)

NUM_SPECIAL_TOKENS = 64
BYTE_OFFSET = NUM_SPECIAL_TOKENS
BYTE_VOCAB_SIZE = BYTE_OFFSET + 256


def _byte_special_tokens() -> tuple[str, ...]:
    reserved = tuple(f"<｜reserved_{i}｜>" for i in range(len(_NAMED_SPECIALS), NUM_SPECIAL_TOKENS))
    return _NAMED_SPECIALS + reserved


BYTE_SPECIAL_TOKENS: tuple[str, ...] = _byte_special_tokens()
# As in DeepSeek-V4's own vocabulary, `｜DSML｜` is an added token but not a special one: it is text
# (tool-call markup), kept when special tokens are skipped and treated as text by grammars.
BYTE_SPECIAL_IDS: frozenset[int] = frozenset(range(NUM_SPECIAL_TOKENS)) - {BYTE_SPECIAL_TOKENS.index(DSML)}


@runtime_checkable
class Tokenizer(Protocol):
    """What the engine and server need from a tokenizer.

    ``encode`` never adds BOS: prompt construction decides that. Special-token strings that
    appear in the text are mapped to their ids, because chat prompts are built as text.

    ``token_bytes(i)`` is the byte string token ``i`` contributes to decoded output (a special
    token contributes its UTF-8 spelling, or ``b""`` when ``skip_special_tokens``). Ids outside
    the vocabulary contribute ``b""`` (a model's embedding table may be padded past the vocabulary).

    ``exact_token_bytes`` says whether those bytes are exact: then the bytes of any id sequence,
    concatenated, are the UTF-8 of ``decode`` (byte-level vocabularies), and a streaming detokeniser
    joins them and emits complete UTF-8 sequences. Otherwise a token's text depends on its
    neighbours (a leading space dropped at the start, ``##`` joins, byte tokens that only form a
    character together): ``token_bytes`` is then the token's text in the middle of a sequence, fit
    for logprobs and grammar masks, and streaming has to decode windows of ids instead.
    """

    vocab_size: int
    bos_token_id: int
    eos_token_id: int
    special_token_ids: frozenset[int]
    exact_token_bytes: bool
    model_type: str | None  # the checkpoint's (config.json): it decides the prompt format

    def encode(self, text: str) -> list[int]: ...

    def encode_text(self, text: str) -> list[int]:
        """`text` as text: a special token's literal in it is its characters, never that token."""
        ...

    def token_to_id(self, token: str) -> int | None: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes: ...

    def vocabulary_json(self) -> str:
        """The vocabulary as a tokenizer.json document (what grammar engines build their masks from)."""
        ...


def _special_pattern(tokens: Sequence[str]) -> re.Pattern[str]:
    # Longest first so that, at a given position, the longest special wins, which is how the
    # `tokenizers` added-vocabulary matcher behaves too.
    ordered = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(re.escape(t) for t in ordered))


class ByteTokenizer:
    """Byte-level tokenizer of the embedded tiny model: specials at 0..63, byte ``b`` at ``64 + b``."""

    vocab_size: int = BYTE_VOCAB_SIZE
    bos_token_id: int = 0
    eos_token_id: int = 1
    pad_token_id: int = 2
    exact_token_bytes: bool = True
    def __init__(self, model_type: str | None = None) -> None:
        """`model_type`: the embedded model's, which decides the prompt format (None: DeepSeek-V4's;
        `tiny-v41` is "deepseek_v41")."""
        self.model_type = model_type
        self.special_tokens: tuple[str, ...] = BYTE_SPECIAL_TOKENS
        self.special_token_ids: frozenset[int] = BYTE_SPECIAL_IDS
        self._special_to_id = {tok: i for i, tok in enumerate(self.special_tokens)}
        self._special_re = _special_pattern(self.special_tokens)
        self._special_bytes = [tok.encode("utf-8") for tok in self.special_tokens]

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        pos = 0
        for match in self._special_re.finditer(text):
            ids.extend(_text_to_byte_ids(text[pos : match.start()]))
            ids.append(self._special_to_id[match.group()])
            pos = match.end()
        ids.extend(_text_to_byte_ids(text[pos:]))
        return ids

    def encode_text(self, text: str) -> list[int]:
        return _text_to_byte_ids(text)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        raw = b"".join(self.token_bytes(i, skip_special_tokens) for i in ids)
        return raw.decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        if BYTE_OFFSET <= token_id < BYTE_VOCAB_SIZE:
            return bytes((token_id - BYTE_OFFSET,))
        if 0 <= token_id < NUM_SPECIAL_TOKENS and not (skip_special_tokens and token_id in self.special_token_ids):
            return self._special_bytes[token_id]
        return b""

    def token_to_id(self, token: str) -> int | None:
        return self._special_to_id.get(token)

    def vocabulary_json(self) -> str:
        return _build_byte_backend().to_str()


def _text_to_byte_ids(text: str) -> list[int]:
    return [BYTE_OFFSET + b for b in text.encode("utf-8")]


def bytes_to_unicode() -> dict[int, str]:
    """The standard byte-level BPE alphabet: every byte gets a printable, non-space character.

    Printable Latin-1 bytes map to themselves; the remaining 68 bytes are shifted to code points
    256 and up, in byte order. Real byte-level ``tokenizer.json`` vocabularies are spelled in
    this alphabet, so it must be reproduced exactly.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), 256)]
    mapping = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + shifted)
            shifted += 1
    return dict(sorted(mapping.items()))


def _build_byte_backend() -> _HFBackend:
    alphabet = bytes_to_unicode()
    vocab = {tok: i for i, tok in enumerate(BYTE_SPECIAL_TOKENS)}
    vocab.update({alphabet[b]: BYTE_OFFSET + b for b in range(256)})
    specials = [t for i, t in enumerate(BYTE_SPECIAL_TOKENS) if i in BYTE_SPECIAL_IDS]
    return _byte_level_backend(vocab, specials, [DSML])


def _byte_level_backend(vocab: dict[str, int], specials: Sequence[str], added: Sequence[str]) -> _HFBackend:
    """A merge-less byte-level BPE over ``vocab``; ``specials`` and ``added`` must already be keys of it."""
    backend = _HFBackend(models.BPE(vocab=vocab, merges=[]))
    # use_regex=False: no word splitting, every byte stays its own token exactly as in
    # ByteTokenizer (with no merges the split would not change ids, but it keeps the file honest).
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    # The added tokens already have ids in the model vocabulary, so registering them reuses those ids.
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in added])
    return backend


def write_byte_tokenizer_files(directory: str | os.PathLike[str]) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` equivalent to :class:`ByteTokenizer`."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    _build_byte_backend().save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1 << 20,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n")


class HFTokenizer:
    """A ``tokenizer.json`` loaded with the ``tokenizers`` library.

    BOS/EOS come from ``tokenizer_config.json`` (token strings) or ``config.json`` (ids), in that
    order, defaulting to 0 and 1 as in DeepSeek-V4.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.path = Path(directory)
        document = (self.path / "tokenizer.json").read_text(encoding="utf-8")
        self._backend = _HFBackend.from_str(document)
        self._text_backend = _without_added_tokens(document)
        self.vocab_size: int = self._backend.get_vocab_size(with_added_tokens=True)
        added = self._backend.get_added_tokens_decoder()
        self.special_token_ids: frozenset[int] = frozenset(i for i, t in added.items() if t.special)
        self._added = added
        self.added_ids: frozenset[int] = frozenset(added)  # special or not (DSML): what `encode_text` never gives
        self._added_bytes = {i: t.content.encode("utf-8") for i, t in added.items()}
        # The decoder is read from the file as JSON rather than asked of the backend object, whose
        # Python bindings need not describe every decoder: an unknown one only costs the fast path.
        decoder = _decoder_section(document)
        self.exact_token_bytes: bool = _is_byte_level(decoder)
        types = _decoder_types(decoder)
        # Pieces spelled in the byte alphabet (ByteLevel) or as <0xXX> (ByteFallback) stand for
        # bytes, whatever else the decoder does with the joined text.
        self._byte_pieces = "ByteLevel" in types
        self._byte_fallback = "ByteFallback" in types
        self._byte_decoder = {c: b for b, c in bytes_to_unicode().items()}
        self._bytes_cache: dict[int, bytes] = {}
        self._anchor: int | None = None if self.exact_token_bytes else self._find_anchor()
        self._grammar_json: str | None = None
        self.model_type: str | None = None
        self.bos_token_id, self.eos_token_id = self._read_bos_eos()

    def encode(self, text: str) -> list[int]:
        return list(self._backend.encode(text, add_special_tokens=False).ids)

    def encode_text(self, text: str) -> list[int]:
        return list(self._text_backend.encode(text, add_special_tokens=False).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_bytes(self, token_id: int, skip_special_tokens: bool = False) -> bytes:
        if skip_special_tokens and token_id in self.special_token_ids:
            return b""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._compute_token_bytes(token_id)
            self._bytes_cache[token_id] = cached
        return cached

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def vocabulary_json(self) -> str:
        if self.exact_token_bytes:
            return self._backend.to_str()
        # Grammar engines (llguidance) read token bytes out of a byte-level or byte-fallback
        # tokenizer.json and refuse any other decoder, so they get the same vocabulary spelled
        # byte-level, each token as the bytes `token_bytes` gives it.
        if self._grammar_json is None:
            self._grammar_json = self._byte_level_twin().to_str()
        return self._grammar_json

    def _compute_token_bytes(self, token_id: int) -> bytes:
        if token_id in self._added_bytes:
            return self._added_bytes[token_id]
        piece = self._backend.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_pieces:
            # Same rule as the ByteLevel decoder: a piece spelled entirely in the byte alphabet
            # stands for those bytes, anything else for its own UTF-8.
            if all(c in self._byte_decoder for c in piece):
                return bytes(self._byte_decoder[c] for c in piece)
            return piece.encode("utf-8")
        raw = _fallback_byte(piece) if self._byte_fallback else None
        if raw is not None:
            return raw
        return self._text_after_anchor(token_id).encode("utf-8")

    def _text_after_anchor(self, token_id: int) -> str:
        # Decoded alone, a token is the first of its text and may lose what it carries mid-text
        # (Metaspace's and Strip's leading space); after a plain word it shows that too.
        if self._anchor is None:
            return self.decode([token_id])
        head = self.decode([self._anchor])
        both = self.decode([self._anchor, token_id])
        return both[len(head):] if both.startswith(head) else self.decode([token_id])

    def _find_anchor(self, limit: int = 4096) -> int | None:
        """A token that decodes to a plain ASCII word wherever it stands, to put other tokens after."""
        for token_id in range(min(limit, self.vocab_size)):
            if token_id in self._added:
                continue
            text = self.decode([token_id])
            if text.isascii() and text.isalnum() and self.decode([token_id, token_id]).startswith(text):
                return token_id
        return None

    def _byte_level_twin(self) -> _HFBackend:
        alphabet = bytes_to_unicode()
        size = max(self._backend.get_vocab(with_added_tokens=True).values(), default=-1) + 1
        vocab = {t.content: i for i, t in self._added.items()}
        for token_id in range(size):
            if token_id in self._added:
                continue
            spelled = "".join(alphabet[b] for b in self.token_bytes(token_id))
            # A placeholder with a space (outside the byte alphabet) keeps ids dense and gives the
            # token no bytes: a duplicate or empty spelling cannot be matched by a grammar.
            vocab[spelled if spelled and spelled not in vocab else f"<unused {token_id}>"] = token_id
        specials = [t.content for t in self._added.values() if t.special]
        added = [t.content for t in self._added.values() if not t.special]
        return _byte_level_backend(vocab, specials, added)

    def _read_bos_eos(self) -> tuple[int, int]:
        bos = eos = None
        tok_cfg = _read_json(self.path / "tokenizer_config.json")
        if tok_cfg is not None:
            bos = self._token_id_from_config(tok_cfg.get("bos_token"))
            eos = self._token_id_from_config(tok_cfg.get("eos_token"))
        model_cfg = _read_json(self.path / "config.json")
        if model_cfg is not None:
            self.model_type = model_cfg.get("model_type") if isinstance(model_cfg.get("model_type"), str) else None
            bos = bos if bos is not None else _first_int(model_cfg.get("bos_token_id"))
            eos = eos if eos is not None else _first_int(model_cfg.get("eos_token_id"))
        return (0 if bos is None else bos), (1 if eos is None else eos)

    def _token_id_from_config(self, entry: Any) -> int | None:
        # tokenizer_config.json spells tokens either as a string or as an AddedToken-like dict.
        if isinstance(entry, dict):
            entry = entry.get("content")
        if not isinstance(entry, str):
            return None
        return self._backend.token_to_id(entry)


def _without_added_tokens(document: str) -> _HFBackend:
    """The tokenizer with no added-token matching: every character goes through the model's own pieces,
    as the text between two added tokens does in the full tokenizer."""
    spec = json.loads(document)
    spec["added_tokens"] = []
    return _HFBackend.from_str(json.dumps(spec))


def input_only_ids(tokenizer: Tokenizer) -> tuple[int, ...]:
    """The ids of `INPUT_ONLY_SPECIALS` in this vocabulary (those it has)."""
    ids = {tokenizer.token_to_id(t) for t in INPUT_ONLY_SPECIALS} - {None, tokenizer.eos_token_id}
    return tuple(sorted(i for i in ids if i is not None))


def encode_rendered(tokenizer: Tokenizer, text: str, special_ranges: Sequence[tuple[int, int]]) -> list[int]:
    """A rendered prompt's ids: each special range is its token, the text between is text (so a literal a
    client wrote stays characters). Where the text holds no literal these are `tokenizer.encode(text)`'s ids:
    the full tokenizer splits at every added token too and encodes the pieces between alone."""
    ids: list[int] = []
    pos = 0
    for start, end in special_ranges:
        if start > pos:
            ids += tokenizer.encode_text(text[pos:start])
        token = tokenizer.token_to_id(text[start:end])
        ids += [token] if token is not None else tokenizer.encode(text[start:end])
        pos = end
    if pos < len(text):
        ids += tokenizer.encode_text(text[pos:])
    return ids


_FALLBACK_BYTE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _fallback_byte(piece: str) -> bytes | None:
    """The byte a ByteFallback token such as ``<0xE2>`` stands for, or None for any other piece."""
    match = _FALLBACK_BYTE.fullmatch(piece)
    return bytes.fromhex(match.group(1)) if match else None


def _decoder_section(document: str) -> Any:
    try:
        return json.loads(document).get("decoder")
    except (ValueError, AttributeError):
        return None


def _decoder_types(decoder: Any) -> list[str]:
    """Every decoder type named in a decoder section, nested Sequences included."""
    if not isinstance(decoder, dict):
        return []
    types = [str(decoder.get("type"))]
    parts = decoder.get("decoders")
    for part in parts if isinstance(parts, list) else []:
        types += _decoder_types(part)
    return types


def _is_byte_level(decoder: Any) -> bool:
    # Only a lone ByteLevel maps each token to bytes independently of its neighbours; any other
    # decoder next to it in a Sequence (even a second ByteLevel) sees the joined text and may
    # change it, so that case takes the general path.
    if not isinstance(decoder, dict):
        return False
    if decoder.get("type") == "ByteLevel":
        return True
    parts = decoder.get("decoders")
    if decoder.get("type") != "Sequence" or not isinstance(parts, list):
        return False
    return len(parts) == 1 and _is_byte_level(parts[0])


def _read_json(path: Path) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    data = json.loads(path.read_text(encoding="utf-8"))
    return data if isinstance(data, dict) else None


def _first_int(value: Any) -> int | None:
    # config.json may list several EOS ids; the first is the canonical one.
    if isinstance(value, list):
        value = value[0] if value else None
    return value if isinstance(value, int) else None


def embedded_tokenizer(model: str) -> ByteTokenizer:
    """The byte tokenizer of an embedded model (`tiny`, `tiny-v41`), with its model's prompt format."""
    return ByteTokenizer("deepseek_v41" if model == "tiny-v41" else None)


def load_tokenizer(path: str | os.PathLike[str] | None) -> Tokenizer:
    """``None`` gives the embedded :class:`ByteTokenizer`; a folder with ``tokenizer.json`` an
    :class:`HFTokenizer`."""
    if path is None:
        return ByteTokenizer()
    folder = Path(path)
    if not folder.is_dir():
        raise FileNotFoundError(f"tokenizer folder {str(folder)!r} does not exist or is not a folder")
    if not (folder / "tokenizer.json").is_file():
        raise FileNotFoundError(f"no tokenizer.json in model folder {str(folder)!r}")
    return HFTokenizer(folder)
