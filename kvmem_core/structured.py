"""Structured output: a grammar masks each decode step's logits, so the answer follows it token by token.

A request's grammar (``SamplingParams.grammar``) is Lark text in llguidance's dialect, where
``%json {...}`` embeds a JSON schema; the server writes it (response formats, strict tool
calls). llguidance (Rust, no torch) computes the mask over the engine's own vocabulary, read
once through the calls both adapters have (``token_bytes``, ``is_eog``, ``tokenize``) into a
``kvmem_core.vocabulary.Vocabulary`` that also keeps each grammar compiled, so the one decode
loop (``kvmem_core.sampling.decode``) serves every backend. It is imported only
when a step carries a grammar: ``kvmem_core`` imports without it.

A grammar with a ``trigger`` (``SamplingParams.grammar_trigger``) is lazy: the text is free
until it ends with the trigger (a tool-call marker), then the grammar runs until it is
complete, and the text is free again until the next trigger.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from functools import cache
from typing import Any, Callable

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.contract import SamplingParams
from kvmem_core.errors import GrammarError
from kvmem_core.vocabulary import Vocabulary

# each byte of llguidance's bitmask as the eight logit offsets it means: 0 where a token is allowed, -inf where not
_BYTE_BIAS = np.where((np.arange(256)[:, None] >> np.arange(8)) & 1, 0.0, -np.inf).astype(np.float32)


@cache
def _planner() -> ThreadPoolExecutor:
    """The one thread that plans next steps' masks while the model computes (llguidance drops the GIL)."""
    return ThreadPoolExecutor(1, thread_name_prefix="kvmem-grammar")


class Formats:
    """One engine's output formats: its vocabulary, read on the first step that has a format."""

    def __init__(self, adapter: EngineAdapter) -> None:
        self.adapter = adapter
        self.vocabulary: Vocabulary | None = None

    def constraint(self, sampling: SamplingParams, n_vocab: int) -> Constraint | None:
        """The step's format as a constraint over the ``n_vocab`` tokens of the logits; None without a format."""
        if sampling.grammar is None:
            return None
        if self.vocabulary is None:
            adapter = self.adapter
            bos = len(adapter.tokenize("", special=False))  # what the tokenizer puts in front of a whole text
            self.vocabulary = Vocabulary(
                n_vocab, adapter.token_bytes, adapter.is_eog, lambda text: adapter.tokenize(text, special=False)[bos:]
            )
        return Constraint(sampling.grammar, self.vocabulary, sampling.grammar_trigger)


def check(grammar: str) -> None:
    """``GrammarError`` (a 400) when ``grammar`` does not compile, or llguidance is not installed."""
    try:
        import llguidance
    except ImportError:
        raise GrammarError("structured output needs the llguidance package: pip install llguidance") from None
    error = llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_lark(grammar))
    if error:
        raise GrammarError(f"the output format does not compile to a grammar: {error}")


class Constraint:
    """One step's grammar over its decode loop: ``choose`` picks a token the grammar allows next (``allow``
    masks the logits to them), ``take`` advances by the token taken. Free (no mask) before a lazy grammar's
    trigger and after it completes.

    A small model can loop inside a JSON string or list until its tokens run out, which would cut the answer
    short of its closing brackets. So the grammar closes the answer itself once the tokens left come near what
    closing takes (``closing_cost``, a dry run of the closing policy on a copy of the grammar's state, checked
    every ``CHECK_EVERY`` tokens within ``WATCH`` of the end, every token nearer), or once the last ``LOOP_SPAN``
    tokens repeat a pattern of at most ``LOOP_PERIOD``. Closing, each token is an end token when the grammar
    is complete, else one it forces, else inside a JSON string the closing quote, else the first of
    ``CLOSERS`` it allows (end a container, else a short value), else its shortest allowed token.
    """

    WATCH, CHECK_EVERY, MARGIN = 256, 8, 4
    LOOP_SPAN, LOOP_PERIOD = 128, 64
    CLOSERS = ("}", "]", ",", "0", "false", "null", '"', "[", "{", ' "', " 0", " false", " null", " [", " {")

    def __init__(self, grammar: str, vocab: Vocabulary, trigger: str | None = None) -> None:
        self.vocab = vocab
        self.trigger = trigger.encode() if trigger else b""
        self.format = vocab.format(grammar)
        self.matcher = self.format.matcher()
        closers = vocab.closers(self.CLOSERS)
        self._closers = tuple(closers.values())
        self._quote = (closers['"'],) if '"' in closers else ()  # the closer inside a string, when one token
        self.active = not self.trigger
        self._bits = np.zeros((vocab.n_vocab + 31) // 32, dtype=np.int32)
        self._bias = np.zeros(self._bits.size * 32, dtype=np.float32)  # the step's offsets, 0 or -inf, made on demand
        self._only: int | None = None  # the planned step's one allowed token: closing's choice, or a forced token
        self._ready = False  # ``_bits`` holds the adopted step's mask
        self._premask = True  # plans ahead make the mask, on the planner thread (off while picks are greedy)
        self.steps = self.masked = 0  # steps under the grammar, and those whose logits were masked
        self._masked = np.zeros(0, dtype=np.float32)  # what ``allow`` returns, rewritten each step
        self._ahead: tuple[int, Callable[[], Plan | None]] | None = None  # the next step's plan, for its ``left``
        self._tail = b""  # the free text's end, where a trigger may be completing
        self._restart()

    def _restart(self) -> None:
        self.closing = False
        self._taken = 0  # tokens under the grammar
        self._repeats = Repeats(self.LOOP_PERIOD, self.LOOP_SPAN)
        self._quotes = Quotes()
        self._need = 0  # tokens closing took at the last dry run

    def allow(self, logits: np.ndarray, left: int) -> np.ndarray:
        """``logits`` with every token the grammar forbids next at -inf; only the closing token, when the answer
        is closing; ``logits`` itself while free. The masked logits are a buffer of the constraint's own, valid
        until its next ``allow``. Uses the plan ``take`` started for this ``left``, else plans now."""
        plan = self._settle(left)
        if plan is None:
            return logits
        self._adopt(plan)
        self._premask = True
        return self._mask(logits)

    def choose(self, logits: np.ndarray, left: int, sample: Callable[[np.ndarray], int], greedy: bool) -> int:
        """The token ``sample`` picks from ``allow(logits, left)``. A ``greedy`` sample (the first best token)
        is tried on the unmasked logits first: when the grammar allows that token it is the masked pick too (the
        best of all tokens is the best of the allowed ones), so the mask is made only where it changes the pick;
        the check is the step's one token when it has one, a bit of the mask when a plan made it ahead, else the
        matcher's test of the one token. Where the step allows one token, that token is the masked pick unless
        the logits hold -inf there or NaN or +inf elsewhere, so the mask is made only then."""
        plan = self._settle(left)
        if plan is None:
            return sample(logits)
        self._adopt(plan)
        self._premask = not greedy
        if greedy:
            token = sample(logits)
            if self._allows(token):
                return token
            if self._only is not None and np.isfinite(logits[token]) and logits[self._only] > -np.inf:
                return self._only  # the masked logits' one finite value (a finite best: no NaN, no +inf)
        return sample(self._mask(logits))

    def _adopt(self, plan: Plan) -> None:
        self.closing, self._need, self._only, self._ready = plan
        self.steps += 1

    def _allows(self, token: int) -> bool:
        """Whether the adopted step's mask allows ``token``: its one token when it has one, a bit of the mask when
        made, else ``_admits``."""
        if self._only is not None:
            return token == self._only
        if self._ready:
            return token < self._bits.size * 32 and bool(self._bits[token >> 5] >> (token & 31) & 1)
        return self._admits(self.matcher, token)

    def _admits(self, matcher: Any, token: int) -> bool:
        """Whether ``matcher``'s mask allows ``token``, told without making it, where the grammar forces no whole
        token (``_forced`` is None): where it forces no bytes the mask allows exactly the tokens the grammar
        accepts, and the end tokens once the answer is complete; where it forces bytes that a longer token may
        extend, the tokens that are a prefix of those bytes or go on from them, what ``validate_tokens`` accepts
        there too (it compares a token with the forced bytes before it parses the rest)."""
        if token >= self.vocab.n_vocab:
            return False
        if token in self.vocab.end_set:
            return bool(matcher.is_accepting())
        return matcher.validate_tokens([token]) == 1

    def _mask(self, logits: np.ndarray) -> np.ndarray:
        """``logits`` plus the adopted plan's offsets, in the constraint's own buffer."""
        if self._only is None:
            if not self._ready:
                self._fill_bits(self.matcher)
                self._ready = True
            np.take(_BYTE_BIAS, self._bits.view(np.uint8), axis=0, out=self._bias.reshape(-1, 8))
        else:
            self._bias.fill(-np.inf)
            self._bias[self._only] = 0.0
        if self._masked.shape != logits.shape or self._masked.dtype != logits.dtype:
            self._masked = np.empty_like(logits)
        self.masked += 1
        return np.add(logits, self._bias[: logits.size], out=self._masked)

    def take(self, token: int, data: bytes, left: int | None = None) -> None:
        """Advance by a sampled ``token`` (``data``: its bytes): the grammar consumes it, or, while free, the
        text is watched for the trigger. A grammar that completed frees the text. With ``left`` (the tokens the
        next step may take), the next step's plan is made too, while the caller runs the model: in line after
        greedy picks (which rarely need the mask: the plan is a few calls, less than a thread's hand-off), else
        on the planner thread, mask included, off the decode's critical path; every other call waits for it."""
        self._settle(None)
        if left is None:
            self._take(token, data)
        elif self._premask:
            self._ahead = (left, _planner().submit(self._take_and_plan, token, data, left, True).result)
        else:
            plan = self._take_and_plan(token, data, left, False)
            self._ahead = (left, lambda: plan)

    def _settle(self, left: int | None) -> Plan | None:
        """Wait for the plan under way; -> the plan for ``left`` (the one under way when it was for ``left``)."""
        ahead, self._ahead = self._ahead, None
        planned = ahead[1]() if ahead is not None else None
        if left is None or (ahead is not None and ahead[0] == left):
            return planned
        return self._plan(left, mask=False)

    def _take_and_plan(self, token: int, data: bytes, left: int, mask: bool) -> Plan | None:
        self._take(token, data)
        return self._plan(left, mask)

    def _plan(self, left: int, mask: bool) -> Plan | None:
        """What the next step with ``left`` tokens to go is: (closing, the closing cost, its one token when closing
        chose one or the grammar forces one, whether its ``mask`` was made into ``_bits``); None while free. Reads
        the state only, so a plan made ahead and not used changes nothing."""
        if not self.active:
            return None
        need = self._need
        if (
            not self.closing
            and left <= self.WATCH
            and (left <= need + 2 * self.MARGIN or self._taken % self.CHECK_EVERY == 0)
        ):
            need = self._closing_cost(left)
        closing = self.closing or left <= need + self.MARGIN or self._repeats.looping()
        if closing:
            return closing, need, self._closer(self.matcher, self._quotes), False
        forced = self._forced(self.matcher)
        if forced is not None:
            return closing, need, forced, False
        if mask:
            self._fill_bits(self.matcher)
        return closing, need, None, mask

    @staticmethod
    def _forced(matcher: Any) -> int | None:
        """The one token ``matcher``'s mask allows where the grammar forces whole tokens (llguidance then masks
        all but the first token of the forced bytes' canonical tokenization); None where it forces none (no bytes
        forced, or a longer token may extend all the forced bytes)."""
        tokens = matcher.compute_ff_tokens()
        return tokens[0] if tokens else None

    def _take(self, token: int, data: bytes) -> None:
        if self.active:
            self.matcher.consume_token(token)
            self._taken += 1
            self._repeats.add(token)
            self._quotes.follow(data)
            if self.trigger and self.matcher.is_accepting():
                self.matcher.reset()
                self.active, self._tail = False, b""
                self._restart()
            return
        text = self._tail + data
        at = text.find(self.trigger)
        if at < 0:
            self._tail = text[-len(self.trigger) :]
            return
        self.active = True
        rest = text[at + len(self.trigger) :]  # what the trigger's token wrote past it
        if rest:
            self.matcher.consume_tokens(self.vocab.tokenizer.tokenize_bytes(rest))

    def _closing_cost(self, limit: int) -> int:
        """``closing_cost(limit)``, where the answer has taken no token (every answer in the format starts alike)
        from the format's one dry run to ``WATCH``: one that ends within ``limit`` ends there for any larger one,
        and one that does not gives its limit."""
        if self._taken or self.trigger:
            return self.closing_cost(limit)
        if self.format.opening_cost is None:
            self.format.opening_cost = self.closing_cost(self.WATCH)
        return min(self.format.opening_cost, limit)

    def closing_cost(self, limit: int) -> int:
        """Tokens the closing policy takes from here to a complete answer (``limit`` when it needs more)."""
        matcher, quotes = self.matcher.deep_copy(), self._quotes.copy()
        for n in range(limit):
            if matcher.is_accepting() or matcher.is_error():
                return n
            token = self._toward_end(matcher, quotes)
            if token is None:
                return limit
            matcher.consume_token(token)
            quotes.follow(self.vocab.token_bytes(token))
        return limit

    def _fill_bits(self, matcher: Any) -> None:
        """``matcher``'s mask into ``_bits`` (one bit per token)."""
        matcher.unsafe_compute_mask_ptr(self._bits.ctypes.data, self._bits.nbytes)

    def _allowed(self, matcher: Any) -> np.ndarray:
        """``matcher``'s mask: in ``_bits``, and as one bool per token (a view of a fresh array)."""
        self._fill_bits(matcher)
        return np.unpackbits(self._bits.view(np.uint8), bitorder="little").view(bool)

    def _closer(self, matcher: Any, quotes: Quotes) -> int | None:
        """The token that brings ``matcher``'s answer nearest its end (see the class docstring); None: the model's.
        The candidates are tested one token each; the whole mask is made only when none is allowed."""
        if matcher.is_accepting() and self.vocab.ends:
            return self.vocab.ends[0]
        return self._toward_end(matcher, quotes)

    def _toward_end(self, matcher: Any, quotes: Quotes) -> int | None:
        """``_closer`` where ``matcher``'s answer is not complete."""
        forced = self._forced(matcher)
        if forced is not None:
            return forced
        candidates = self._quote if quotes.inside and self._quote else self._closers
        chosen = next((t for t in candidates if self._admits(matcher, t)), None)
        if chosen is None:
            rest = np.flatnonzero(self._allowed(matcher)[: self.vocab.n_vocab])
            chosen = int(rest[np.argmin(self.vocab.lengths[rest])]) if rest.size else None
        return chosen


Plan = tuple[bool, int, int | None, bool]
"""A step's plan: whether the answer is closing, the tokens closing took at the last dry run, the one token the
step allows (closing's choice or the grammar's forced token; None: the grammar's mask), and whether the mask is made
(in ``_bits``)."""


class Repeats:
    """Whether the latest ``span`` tokens repeat with a period of at most ``period``. Kept as a run per period p:
    how many of the latest tokens each equal the token p before them (the last n tokens repeat with period p when
    that run reaches n). Only the periods with a run are kept: a token extends the runs of the periods at which it
    occurred before, and ends the others. No run reaches ``span`` before ``span`` tokens are in, so the runs are
    counted from the tokens kept until then, once there are that many (most answers end sooner)."""

    def __init__(self, period: int, span: int) -> None:
        self.period, self.span = period, span
        self.recent: list[int] = []  # the latest tokens, oldest first: all of them, from ``span`` on the ``period``
        self.runs: dict[int, int] | None = None  # from ``span`` tokens on

    def add(self, token: int) -> None:
        recent = self.recent
        if self.runs is None:
            recent.append(token)
            if len(recent) == self.span:
                self.runs = _runs(recent, self.period)
                del recent[: -self.period]
            return
        runs, at = {}, -1
        if token in recent:  # most tokens did not occur in the last ``period``
            while (at := _index(recent, token, at + 1)) >= 0:
                period = len(recent) - at
                runs[period] = self.runs.get(period, 0) + 1
        self.runs = runs
        recent.append(token)
        if len(recent) > self.period:
            del recent[0]

    def looping(self) -> bool:
        """Whether the latest ``span`` tokens repeat with some period of at most ``period``."""
        return self.runs is not None and max(self.runs.values(), default=0) >= self.span


def _runs(tokens: list[int], period: int) -> dict[int, int]:
    """For each period p up to ``period`` with a run: how many of the last ``tokens`` each equal the token p before."""
    runs, n = {}, len(tokens)
    for p in range(1, min(period, n - 1) + 1):
        run = 0
        while run < n - p and tokens[n - 1 - run] == tokens[n - 1 - run - p]:
            run += 1
        if run:
            runs[p] = run
    return runs


def _index(items: list[int], item: int, start: int) -> int:
    """Where ``item`` next occurs in ``items`` from ``start``; -1 where it does not."""
    try:
        return items.index(item, start)
    except ValueError:
        return -1


class Quotes:
    """Whether JSON text so far ends inside a string (its quotes and backslash escapes followed byte by byte)."""

    def __init__(self, inside: bool = False, escaped: bool = False) -> None:
        self.inside, self.escaped = inside, escaped

    def copy(self) -> Quotes:
        return Quotes(self.inside, self.escaped)

    def follow(self, data: bytes) -> None:
        if not self.escaped and b'"' not in data and b"\\" not in data:
            return  # most tokens: no byte changes the state
        for byte in data:
            if self.escaped:
                self.escaped = False
            elif byte == 0x5C and self.inside:  # a backslash
                self.escaped = True
            elif byte == 0x22:  # a double quote
                self.inside = not self.inside
