"""Prompt-lookup drafting: guesses of the next tokens copied from the workspace's own history.

Agents re-emit text they have seen (file contents, tool arguments, code edits). After each
token, the newest ``n`` tokens (``n`` from ``ngram_max`` down to ``ngram_min``) are searched
for in the history, newest match first; the up to ``k`` tokens that followed that match are the
draft. This is prompt-lookup decoding (apoorvumang/prompt-lookup-decoding, llama.cpp's
``lookup`` example, transformers' ``prompt_lookup_num_tokens``). A draft is only a guess: the
engine verifies it against the model (``kvmem_core.speculative``), so a bad one costs time, never
output.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

DRAFT_TOKENS = 32  # k: the longest draft; how much of it a verification carries is ``draft_budget``'s choice
NGRAM_MAX = 4
NGRAM_MIN = 2  # single-token matches are common in any text and mostly wrong


class LookupDrafter:
    """The history (the transcript the request sent, all of it, plus the tokens generated so far) and drafts
    taken from it; ``extend`` adds generated tokens, ``propose`` drafts the next ones."""

    def __init__(
        self,
        history: Sequence[int] | np.ndarray,
        *,
        k: int = DRAFT_TOKENS,
        ngram_max: int = NGRAM_MAX,
        ngram_min: int = NGRAM_MIN,
    ) -> None:
        assert k >= 1 and 1 <= ngram_min <= ngram_max
        self.k, self.ngram_max, self.ngram_min = k, ngram_max, ngram_min
        self._ids = np.asarray(history, dtype=np.int64)
        self._size = self._ids.size

    @property
    def tokens(self) -> np.ndarray:
        """The history as it stands (a view, not to be written)."""
        return self._ids[: self._size]

    def extend(self, tokens: Sequence[int]) -> None:
        """Append generated tokens to the history."""
        need = self._size + len(tokens)
        if need > self._ids.size:
            grown = np.empty(max(need, 2 * self._ids.size, 64), dtype=np.int64)
            grown[: self._size] = self._ids[: self._size]
            self._ids = grown
        self._ids[self._size : need] = tokens
        self._size = need

    def propose(self, limit: int | None = None) -> list[int]:
        """Up to ``min(k, limit)`` tokens that followed the newest earlier occurrence of the history's last ``n``
        tokens, for the largest ``n`` in ``[ngram_min, ngram_max]`` that has one; [] when none has."""
        k = self.k if limit is None else min(self.k, limit)
        ids, size = self.tokens, self._size
        if k <= 0:
            return []
        for n in range(min(self.ngram_max, size - 1), self.ngram_min - 1, -1):
            start = _newest_match(ids, size - n, n)
            if start is not None:
                return ids[start + n : min(start + n + k, size)].tolist()
        return []


def _newest_match(ids: np.ndarray, tail: int, n: int) -> int | None:
    """The largest ``i < tail`` with ``ids[i:i+n] == ids[tail:tail+n]``, or None (``tail + n`` is the history's
    length, so a match always has at least one token after it)."""
    pattern = ids[tail : tail + n]
    hits = np.flatnonzero(ids[:tail] == pattern[0])
    for j in range(1, n):
        hits = hits[ids[hits + j] == pattern[j]]  # hits + j <= tail - 1 + j < tail + n: in range
        if not hits.size:
            return None
    return int(hits[-1]) if hits.size else None
