"""Turning logits into streamed text: token sampling, stop strings, the decode loop.

This is the one implementation every backend's steps use. ``Sampler`` draws a token from
logits. ``TextStream`` turns the sampled tokens' bytes into text pieces for the client and
cuts the text before the first stop string; it holds back the longest tail that could
still begin a stop string, so what it has streamed always equals the final text, however
the tokens split the stop. ``decode`` runs the loop of one step over both.
"""

from __future__ import annotations

import codecs
from dataclasses import replace
from typing import Callable, Protocol, Sequence

import numpy as np

from kvmem_core.contract import OnText, SamplingParams

Advance = Callable[[int], Callable[[], np.ndarray]]
"""Starts one sampled token through the model (committing it); -> a call that waits for the next logits, so the
token's text can stream while the device computes."""


class Steer(Protocol):
    """Takes over some tokens of a decode loop (``kvmem_core.reasoning.Thinking`` ends think blocks)."""

    lead: str  # text the step's text starts with, ahead of the first token's
    inside: bool  # the text is in a span no output format covers (a think block)

    def forced(self) -> int | None:
        """The next token to take instead of sampling, or None."""
        ...

    def observe(self, data: bytes) -> None:
        """The bytes of each token taken, forced or sampled."""
        ...


class Constraint(Protocol):
    """Masks the logits to what an output format allows next (``kvmem_core.structured.Constraint``)."""

    def allow(self, logits: np.ndarray, left: int) -> np.ndarray:
        """``logits`` with the tokens the format forbids next at -inf; ``left``: tokens the answer may still take."""
        ...

    def choose(self, logits: np.ndarray, left: int, sample: Callable[[np.ndarray], int], greedy: bool) -> int:
        """The token ``sample`` picks from ``allow(logits, left)`` (``greedy``: ``sample`` takes the first best)."""
        ...

    def take(self, token: int, data: bytes, left: int | None = None) -> None:
        """A token sampled under the mask (``data``: its bytes); ``left``: the tokens the next step may take, when
        there is one (the constraint may prepare its mask while the model computes that step's logits)."""
        ...


class Sampler:
    """Greedy at temperature 0; otherwise temperature, top-k, top-p over float64 probabilities, drawn among the
    tokens the filters keep (``kept_probs``): a vocabulary-wide sort and draw would cost a decode step several ms.

    A given ``seed`` reproduces the same draws from the same logits.
    """

    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.rng = np.random.default_rng(params.seed)

    @property
    def greedy(self) -> bool:
        """Whether every pick is the first best token."""
        return self.params.temperature <= 0

    def __call__(self, logits: np.ndarray) -> int:
        p = self.params
        if p.temperature <= 0:
            return int(np.argmax(logits))
        with np.errstate(over="ignore"):
            top = np.float64(logits.max()) / p.temperature
        if np.isposinf(top):  # a temperature so small the logits overflow: its limit, greedy
            return int(np.argmax(logits))
        tokens, probs = kept_probs(logits, p.top_k, p.top_p, p.temperature)
        return int(tokens[self.rng.choice(tokens.size, p=probs)])


def kept_probs(logits: np.ndarray, top_k: int, top_p: float, temperature: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """The tokens of ``logits`` / ``temperature`` (> 0) that top-k (0: all) and then top-p keep, ascending, and
    their probabilities (summing to 1). Top-k keeps every token tied with the k-th best, chosen on the logits as
    given (a positive temperature keeps their order and ties), so only the kept ones are scaled in float64; top-p
    keeps the tokens ranked by probability (ties by id) until the mass before a token reaches ``top_p`` (the token
    that crosses it is kept), looking only as deep as that cut (``_top_p_cut``)."""
    if 0 < top_k < logits.size:
        tokens = _best(logits, top_k)
        chosen = logits[tokens]
    else:
        tokens, chosen = np.arange(logits.size), logits
    with np.errstate(over="ignore"):
        z = chosen.astype(np.float64) / temperature
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        kept = _top_p_cut(probs, top_p)
        tokens, probs = tokens[kept], probs[kept] / probs[kept].sum()
    return tokens, probs


def _top_p_cut(probs: np.ndarray, top_p: float, first: int = 64) -> np.ndarray:
    """Positions (ascending) of the highest ``probs``, ties by position, until the mass before one reaches
    ``top_p``: the best ``first`` and every one tied with the last of them, sorted and summed; four times as many
    while all of those fall short."""
    n = first
    while True:
        deep = np.arange(probs.size) if n >= probs.size else _best(probs, n)
        order = deep[np.argsort(-probs[deep], kind="stable")]
        keep = np.cumsum(probs[order]) - probs[order] < top_p
        if not keep[-1] or deep.size == probs.size:
            return np.sort(order[keep])
        n *= 4


def _best(values: np.ndarray, n: int) -> np.ndarray:
    """Positions (ascending) of the ``n`` largest ``values`` (0 < n < size) and of every value tied with the n-th."""
    return np.flatnonzero(values >= np.partition(values, values.size - n)[values.size - n])


class TextStream:
    """UTF-8 token bytes in, text pieces out through ``on_text``, cut before the first stop string.

    ``push`` returns ``"stop"`` once a stop string completed, ``"abort"`` when ``on_text``
    returned False, else None. ``close`` releases the held-back tail and returns the final
    text; for a step that was not aborted, the pieces streamed concatenate to it.
    """

    def __init__(self, stops: Sequence[str], on_text: OnText) -> None:
        self.stops = tuple(s for s in stops if s)
        self.on_text = on_text
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.text = ""
        self.sent = 0  # characters of ``text`` already streamed
        self.ended: str | None = None

    def push(self, data: bytes) -> str | None:
        """Add one token's bytes (see class docstring)."""
        assert self.ended is None, "push after the stream ended"
        self._add(self.decoder.decode(data), final=False)
        return self.ended

    def close(self) -> str:
        """End of generation: flush the decoder and stream what was held back; -> the final text."""
        if self.ended is None:
            self._add(self.decoder.decode(b"", final=True), final=True)
        return self.text

    def _add(self, piece: str, final: bool) -> None:
        self.text += piece
        cut = stop_cut(self.text, len(piece), self.stops)
        if cut is not None:
            self.text = self.text[:cut]
            self._emit(len(self.text))
            self.ended = "stop"
            return
        if not self._emit(len(self.text) - (0 if final else held_back(self.text, self.stops))):
            self.ended = "abort"

    def _emit(self, end: int) -> bool:
        """Stream ``text[sent:end]``; False when the client is gone."""
        if end <= self.sent:
            return True
        piece, self.sent = self.text[self.sent : end], end
        return self.on_text(piece) is not False


def stop_cut(text: str, new: int, stops: Sequence[str]) -> int | None:
    """Where ``text`` ends before a stop string that its last ``new`` characters completed (the earliest
    such), or None. Only the tail can hold a new match, so the work per token does not grow with the text."""
    hits = [i for s in stops if (i := text.find(s, max(0, len(text) - new - len(s) + 1))) >= 0]
    return min(hits) if hits else None


def held_back(text: str, stops: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of some stop string."""
    return max((_partial(text, s) for s in stops), default=0)


def _partial(text: str, stop: str) -> int:
    j = text.find(stop[0], max(0, len(text) - len(stop) + 1))
    while j >= 0:
        if stop.startswith(text[j:]):
            return len(text) - j
        j = text.find(stop[0], j + 1)
    return 0


def within(params: SamplingParams, room: int) -> SamplingParams:
    """``params`` with a number for ``max_tokens``: its own, or ``room`` (what the workspace has left, at most the
    model's trained context) for None."""
    return params if params.max_tokens is not None else replace(params, max_tokens=room)


def decode(
    params: SamplingParams,
    logits: np.ndarray,
    token_bytes: Callable[[int], bytes],
    is_eog: Callable[[int], bool],
    advance: Advance,
    on_text: OnText,
    steer: Steer | None = None,
    constraint: Constraint | None = None,
    alive: Callable[[], bool] | None = None,
) -> tuple[str, list[int], str]:
    """Sample up to ``params.max_tokens`` tokens from ``logits`` on; -> (text, token ids, finish reason).

    Every sampled token but an end-of-generation one is in the ids (the one that completed a
    stop string too); ``advance`` runs each of them but the ``max_tokens``-th through the model, the one
    that completes a stop string included (the model runs it while its text streams). The finish
    reason is ``stop`` (end of generation or a stop string), ``length`` or ``abort``. A
    ``steer`` may force tokens in place of sampled ones; its ``lead`` starts the text (and
    is streamed first), outside the ids. A ``constraint`` masks the logits of every token
    sampled outside the steer's free spans (forced tokens and think blocks are not its). ``alive`` is
    asked after every token: False ends with ``abort`` there, also while no text streams (a tail held back
    for a stop string, a partial UTF-8 character), where ``on_text`` is not called.
    """
    sample, stream = Sampler(params), TextStream(params.stop, on_text)
    lead = steer.lead if steer is not None else ""
    if lead:
        on_text(lead)
    ids: list[int] = []
    finish = "length"
    max_tokens = params.max_tokens
    assert max_tokens is not None, "decode takes a number of tokens (see within)"
    for i in range(max_tokens):
        forced = steer.forced() if steer is not None else None
        shaping = constraint if forced is None and not (steer is not None and steer.inside) else None
        if forced is not None:
            token = forced
        elif shaping is not None:
            token = shaping.choose(logits, max_tokens - i, sample, sample.greedy)
        else:
            token = sample(logits)
        if is_eog(token):
            finish = "stop"
            break
        ids.append(token)
        more, data = i + 1 < max_tokens, token_bytes(token)
        next_logits = advance(token) if more else None
        if shaping is not None:  # after the step is launched: a device computes it while the next mask is made
            shaping.take(token, data, max_tokens - i - 1 if more else None)
        if steer is not None:
            steer.observe(data)
        ended = stream.push(data)
        if ended is None and alive is not None and not alive():
            ended = stream.ended = "abort"  # what is held back stays unsent: nobody reads it
        if ended is not None:
            finish = ended
            break
        if next_logits is not None:
            logits = next_logits()
    return lead + stream.close(), ids, finish
