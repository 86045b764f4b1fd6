"""An engine's vocabulary as llguidance reads it (``kvmem_core.structured`` masks decode steps over it): the
token bytes with control tokens marked, the end tokens, a text tokenizer, and the formats compiled over it."""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_core.errors import GrammarError

_CONTROL = re.compile(rb"<\|[^|<>]{1,64}\|>")  # <|im_end|>, <|eot_id|>: control tokens, never grammar text


class Vocabulary:
    """An engine's vocabulary as llguidance's tokenizer, built on first use (one pass over the token bytes)."""

    COMPILED = 32

    def __init__(
        self,
        n_vocab: int,
        token_bytes: Callable[[int], bytes],
        is_eog: Callable[[int], bool],
        tokenize: Callable[[str], Sequence[int]],
    ) -> None:
        self.n_vocab = n_vocab
        self._token_bytes, self._is_eog, self._tokenize = token_bytes, is_eog, tokenize
        self._tokenizer: Any = None
        self._closers: dict[str, int] | None = None
        self._compile = lru_cache(maxsize=self.COMPILED)(self._compile_new)  # grammar text -> its CompiledFormat
        self.lengths = np.zeros(0, dtype=np.int64)  # each token's bytes (control tokens: very long), once built
        self._bytes: list[bytes] = []  # each token's bytes, once built

    def token_bytes(self, token: int) -> bytes:
        return self._bytes[token] if token < len(self._bytes) else self._token_bytes(token)

    @property
    def ends(self) -> list[int]:
        """The end-of-generation tokens."""
        return self.tokenizer.eos_tokens

    @cached_property
    def end_set(self) -> frozenset[int]:
        return frozenset(self.ends)

    def closers(self, texts: tuple[str, ...]) -> dict[str, int]:
        """The token of each of ``texts`` that is one token, in that order (made once: one set of texts)."""
        if self._closers is None:
            ids = {text: self._tokenize(text) for text in texts}
            self._closers = {text: t[0] for text, t in ids.items() if len(t) == 1}
        return self._closers

    def format(self, grammar: str) -> CompiledFormat:
        """``grammar`` (Lark text) as kept for its answers: compiled on its first use, one of the ``COMPILED``
        latest (an agent sends one format on every turn: compiling a JSON schema takes milliseconds, a copy of the
        compiled matcher microseconds). ``GrammarError`` when it does not compile."""
        return self._compile(grammar)

    def _compile_new(self, grammar: str) -> CompiledFormat:
        import llguidance

        compiled = llguidance.LLMatcher(self.tokenizer, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
        if compiled.is_error():
            raise GrammarError(f"the output format does not compile to a grammar: {compiled.get_error()}")
        return CompiledFormat(compiled)

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = self._build()
        return self._tokenizer

    def _build(self) -> Any:
        import llguidance

        eog = [t for t in range(self.n_vocab) if self._is_eog(t)]
        ends = set(eog)
        self._bytes = [self._token_bytes(t) for t in range(self.n_vocab)]
        tokens = [self._marked(t, ends) for t in range(self.n_vocab)]
        self.lengths = np.array([len(b) if b[:1] != b"\xff" else 1 << 20 for b in tokens], dtype=np.int64)
        wrapper = _Wrapper(tokens, eog, self._tokenize)
        return llguidance.LLTokenizer(wrapper, n_vocab=self.n_vocab, eos_token=eog)  # type: ignore[arg-type]

    def _marked(self, token: int, eog: set[int]) -> bytes:
        """A token's bytes, with llguidance's 0xFF prefix on control tokens (no grammar text may use them)."""
        data = self._bytes[token]
        return b"\xff" + data if token in eog or _CONTROL.fullmatch(data) else data


@dataclass
class CompiledFormat:
    """A compiled output format: its matcher before any token (answers take copies), and what its answers
    compute alike from there, once (``kvmem_core.structured`` fills it in)."""

    compiled: Any
    opening_cost: int | None = None  # the closing dry run's tokens from an answer's start, up to its limit

    def matcher(self) -> Any:
        """A fresh matcher of the format."""
        return self.compiled.deep_copy()


class _Wrapper:
    """What ``llguidance.LLTokenizer`` reads from a tokenizer: token bytes, end tokens, a text tokenizer."""

    def __init__(self, tokens: list[bytes], eog: list[int], tokenize: Callable[[str], Sequence[int]]) -> None:
        self.tokens = tokens
        self.eos_token_id = eog[0] if eog else 0
        self.bos_token_id = None
        self.special_token_ids = list(eog)
        self.is_tokenizer_wrapper = True
        # llguidance tokenizes the bytes a grammar forces on every mask and forced-token call: the same few texts
        self._tokenize = lru_cache(maxsize=4096)(lambda text: tuple(tokenize(text)))

    def __call__(self, text: str | bytes) -> list[int]:
        return list(self._tokenize(text.decode("utf-8", "replace") if isinstance(text, bytes) else text))
