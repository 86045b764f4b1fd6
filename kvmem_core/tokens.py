"""Incremental tokenization: a text that starts like one tokenized before costs its new part.

An agent re-sends its transcript every turn with new messages at the end, so the text of turn
N+1 starts with most of turn N's. Byte-level BPE tokenizers (llama.cpp's and HF ``tokenizers``')
first cut their input at every control token and tokenize the pieces between independently, so
``ids(a + b) == ids(a) + ids(b)`` wherever ``b`` starts with a control token the tokenizer cuts
at. ``PrefixTokenizer`` keeps the last few long texts it tokenized with their ids and, for a new
text, reuses the ids before the last such cut inside the prefix it shares with a kept one and
tokenizes only the rest.

Only *clean* cuts are used (``clean_cuts``): control tokens no other token's text overlaps in
part, that no token's text extends (so an occurrence is always that one token), and that strip
no whitespace in front of themselves. Their every occurrence is a cut, whatever surrounds it.
"""

from __future__ import annotations

import re
import threading
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

KEEP = 4  # texts kept: an agent's current transcript and a few others (1M tokens cost ~8 MB of ids each)
MIN_CHARS = 4096  # shorter texts are tokenized whole, and not kept: they cost little either way
_CHUNKS = (1 << 16, 1 << 10, 1 << 4, 1)  # sizes of the pieces compared in turn, narrowing to the first difference


def clean_cuts(candidates: Mapping[str, int], token_texts: Iterable[str]) -> dict[str, int]:
    """The ``candidates`` (text -> id of a control token the tokenizer cuts at, with nothing stripped in front of
    it) whose every occurrence in any text is a cut where exactly that token starts: no text of ``token_texts``
    (every token the tokenizer cuts at, candidates included) overlaps an occurrence in part or starts with it,
    and no other token has the same text."""
    texts = Counter(t for t in token_texts if t)
    return {
        text: token
        for text, token in candidates.items()
        if text and texts[text] <= 1 and not any(_overlaps(text, other) for other in texts)
    }


def _overlaps(cut: str, other: str) -> bool:
    """Whether an occurrence of ``other`` can overlap one of ``cut`` other than by being it or a shorter token it
    starts with: starting where it starts and longer, starting inside it, or starting before it and reaching in."""
    longer = other != cut and other.startswith(cut)
    inside = any(_agree(cut[d:], other) for d in range(1, len(cut)))
    reaching = any(_agree(other[d:], cut) for d in range(1, len(other)))
    return longer or inside or reaching


def _agree(a: str, b: str) -> bool:
    """Whether texts ``a`` and ``b`` can both start at one place: one is a prefix of the other."""
    return a.startswith(b) or b.startswith(a)


@dataclass(frozen=True)
class _Kept:
    """A tokenized text with where its cuts are: ``starts``/``ends`` (character offsets of each occurrence of a cut
    token's text, in order) and ``at`` (each one's index in ``ids``); ``ids``: a read-only int64 array."""

    text: str
    ids: np.ndarray
    starts: list[int]
    ends: list[int]
    at: list[int]


class PrefixTokenizer:
    """``encode`` (a whole text's ids) made incremental across texts that share a prefix, with the same result.

    ``cuts`` gives, when first needed, the text of each clean cut (see ``clean_cuts``) and its token id; with
    none, every text is tokenized whole. Calls may come from several threads.
    """

    def __init__(self, encode: Callable[[str], list[int]], cuts: Callable[[], Mapping[str, int]]) -> None:
        self._encode = encode
        self._cut_source: Callable[[], Mapping[str, int]] | None = cuts
        self._cuts: dict[str, int] = {}
        self._cut_ids = np.zeros(0, dtype=np.int64)
        self._find: re.Pattern[str] | None = None
        self._kept: list[_Kept] = []
        self._lock = threading.Lock()

    def __call__(self, text: str) -> list[int]:
        """Token ids of ``text``: ``encode(text)`` (a long text's through ``array``)."""
        return self._encode(text) if self._whole(text) else self.array(text).tolist()

    def array(self, text: str) -> np.ndarray:
        """``encode(text)`` as a read-only int64 array, tokenized from the latest cut inside the prefix it shares
        with a kept text on (the ids before it are that text's). Never a Python list of the whole text's ids: at a
        million tokens, building one costs milliseconds and so does the collector's every walk over it."""
        if self._whole(text):
            return read_only(np.asarray(self._encode(text), dtype=np.int64))
        with self._lock:
            kept = list(self._kept)
        base, j = _NOTHING, -1
        for entry in kept:
            i = bisect_right(entry.ends, common_prefix(entry.text, text)) - 1
            if i >= 0 and (j < 0 or entry.starts[i] > base.starts[j]):
                base, j = entry, i
        start, n_head = (base.starts[j], base.at[j]) if j >= 0 else (0, 0)
        ids = read_only(np.concatenate((base.ids[:n_head], np.asarray(self._encode(text[start:]), dtype=np.int64))))
        self._keep(text, ids, base, max(j, 0), start, n_head)
        return ids

    def _whole(self, text: str) -> bool:
        """Whether ``text`` is tokenized whole: it is short, or the tokenizer has no cuts."""
        return len(text) < MIN_CHARS or not self._load_cuts()

    def _load_cuts(self) -> bool:
        """Whether there are cuts (read from the source the first time)."""
        with self._lock:
            if self._cut_source is not None:
                self._cuts = dict(self._cut_source())
                self._cut_ids = np.array(sorted(set(self._cuts.values())), dtype=np.int64)
                self._find = re.compile("|".join(re.escape(t) for t in self._cuts)) if self._cuts else None
                self._cut_source = None
        return self._find is not None

    def _keep(self, text: str, ids: np.ndarray, base: _Kept, reused: int, start: int, n_head: int) -> None:
        """Keep ``text`` and ``ids`` (tokenized from character ``start``, token ``n_head`` on) with their cuts: the
        first ``reused`` of ``base``, then those found from ``start`` on. A text whose cut tokens do not pair one to
        one with its cut texts, or that has none, is not kept. It replaces a kept text it extends."""
        assert self._find is not None
        found = list(self._find.finditer(text, start))
        at = (np.flatnonzero(np.isin(ids[n_head:], self._cut_ids)) + n_head).tolist()
        if not found or len(at) != len(found) or any(ids[i] != self._cuts[m.group()] for i, m in zip(at, found)):
            return
        entry = _Kept(
            text,
            ids,
            base.starts[:reused] + [m.start() for m in found],
            base.ends[:reused] + [m.end() for m in found],
            base.at[:reused] + at,
        )
        with self._lock:
            rest = [k for k in self._kept if not text.startswith(k.text)]
            self._kept = [entry, *rest[: KEEP - 1]]


_NOTHING = _Kept("", np.zeros(0, dtype=np.int64), [], [], [])


def read_only(array: np.ndarray) -> np.ndarray:
    """``array``, no longer writeable (what may be shared between a step's phases without copies)."""
    array.flags.writeable = False
    return array


def common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix of ``a`` and ``b``: compared a chunk at a time, then in smaller chunks
    inside the first that differs."""
    n, at = min(len(a), len(b)), 0
    for size in _CHUNKS:
        while at + size <= n and a.startswith(b[at : at + size], at):
            at += size
    return at
