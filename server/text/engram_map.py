"""The Engram map of a tokenizer (DeepSeek-V4.1's n-gram memory reads token ids through it): text
belongs to the front end, so the engine gets the map as ids (engine/model/v41/engram.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def folded_token_ids(tokenizer_json: str | Path) -> list[int]:
    """The Engram map of a tokenizer (`tokenizer.json`'s path): each id → the index of its
    normalised text among the distinct ones, in id order."""
    from tokenizers import Tokenizer

    return _fold(Tokenizer.from_file(str(tokenizer_json)))


def folded_vocabulary(vocabulary_json: str) -> list[int]:
    """The same from a tokenizer.json document's text (an embedded tokenizer's `vocabulary_json()`)."""
    from tokenizers import Tokenizer

    return _fold(Tokenizer.from_str(vocabulary_json))


def _fold(tok: Any) -> list[int]:
    from tokenizers import Regex, normalizers

    sentinel = "\ue000"  # keeps a lone space a space through the strip
    norm = normalizers.Sequence([
        normalizers.NFKC(), normalizers.NFD(), normalizers.StripAccents(), normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "), normalizers.Replace(Regex(r"^ $"), sentinel),
        normalizers.Strip(), normalizers.Replace(sentinel, " "),
    ])
    index: dict[str, int] = {}
    out = []
    for i in range(tok.get_vocab_size(with_added_tokens=True)):
        text = tok.decode([i], skip_special_tokens=False)
        # A token that is part of a character (its bytes alone do not decode) keys by its spelling.
        key = tok.id_to_token(i) if "\ufffd" in text else (norm.normalize_str(text) or text)
        out.append(index.setdefault(key, len(index)))
    return out
