"""The token counts behind the repetition, frequency and presence penalties, kept on the device.

Each penalised request owns one row of two tensors: `seen` (its prompt and output tokens, for the
repetition penalty) and `counts` (how often it has output each token, for the frequency and presence
penalties). A row is filled once, when the request is first sampled with a penalty, and then brought up
to date with the tokens made since its last step: a step uploads each row's new tokens (usually one),
never a request's whole context, so its host cost is flat in context length.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from v4serve.kernels.attention import upload


@dataclass
class _Row:
    index: int
    counted: int  # output tokens already in the row


class PenaltyCounts:
    """Rows of `seen` [rows, V] (bool) and `counts` [rows, V] (fp32), one per penalised request, grown
    by doubling as requests come; a finished request's row is reused, and both are released when no
    request is penalised (5 bytes per token of the vocabulary per row: 165 MB for 256 rows at V4's)."""

    def __init__(self, vocab: int, device: torch.device) -> None:
        self.vocab = vocab
        self.device = device
        self.seen = torch.zeros(0, vocab, dtype=torch.bool, device=device)
        self.counts = torch.zeros(0, vocab, dtype=torch.float32, device=device)
        self._rows: dict[str, _Row] = {}
        self._free: list[int] = []

    def forget(self, key: str) -> None:
        row = self._rows.pop(key, None)
        if row is not None:
            self._free.append(row.index)
        if not self._rows and self.seen.shape[0]:  # nobody penalised now: give the memory back
            self.seen, self.counts = self.seen.new_zeros(0, self.vocab), self.counts.new_zeros(0, self.vocab)
            self._free = []

    def rows(self, requests: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> list[int]:
        """The row of each (key, prompt, output), brought up to date with all of `output` in one upload."""
        fresh = list(dict.fromkeys(key for key, _, _ in requests if key not in self._rows))  # a key may repeat
        self._take(fresh)
        unfilled = set(fresh)
        seen_rows: list[int] = []
        seen_tokens: list[int] = []
        count_rows: list[int] = []
        count_tokens: list[int] = []
        indices = []
        for key, prompt, output in requests:
            row = self._rows[key]
            indices.append(row.index)
            if key in unfilled:  # a new row: the prompt once
                unfilled.discard(key)
                seen_rows += [row.index] * len(prompt)
                seen_tokens += prompt
            new = output[row.counted:]
            seen_rows += [row.index] * len(new)
            seen_tokens += new
            count_rows += [row.index] * len(new)
            count_tokens += new
            row.counted = len(output)
        if seen_rows:
            r, t = upload(seen_rows + seen_tokens, self.device).split(len(seen_rows))
            self.seen.index_put_((r, t), torch.ones((), dtype=torch.bool, device=self.device))
        if count_rows:
            r, t = upload(count_rows + count_tokens, self.device).split(len(count_rows))
            self.counts.index_put_((r, t), torch.ones((), device=self.device), accumulate=True)
        return indices

    def _take(self, keys: list[str]) -> None:
        if not keys:
            return
        while len(self._free) < len(keys):  # double the rows
            have = self.seen.shape[0]
            grow = max(have, len(keys) - len(self._free), 4)
            self.seen = torch.cat([self.seen, self.seen.new_zeros(grow, self.vocab)])
            self.counts = torch.cat([self.counts, self.counts.new_zeros(grow, self.vocab)])
            self._free += range(have + grow - 1, have - 1, -1)
        taken = [self._free.pop() for _ in keys]
        index = upload(taken, self.device)
        self.seen[index] = False  # a reused row
        self.counts[index] = 0.0
        for key, i in zip(keys, taken, strict=True):
            self._rows[key] = _Row(i, 0)
