"""Lossless speculative decoding for greedy steps: each token runs with a draft, verified in the same forward.

Drafts come from a ``Drafter``: prompt lookup (``kvmem_core.lookup``, any engine) or the model's own MTP layers
(``mtp``: the adapter's ``draft_head()``, on models that carry them: ``Capabilities.draft_head``).

``LookupAdvance`` is an ``Advance`` (``kvmem_core.sampling.decode``'s per-token callback), so the decode loop,
its stop strings, end-of-generation tokens and length limit see every token exactly as without speculation.
When the loop hands it a token, it asks the drafter for the tokens likely to follow,
runs the token and the draft in one forward with logits at every position, and keeps the longest draft prefix
that greedy decoding would have chosen itself (each draft token the argmax of the logits before it). The cells
of the rejected tokens leave the view at once. The logits of the kept positions then answer the loop's next
calls without a forward; the first token past them (the model's own choice after the last kept one, the bonus
token) starts the next forward. Only greedy steps without an output format speculate: a sampled token is not
the argmax, and a grammar's mask changes the choice (``kvmem_core.engine`` decides).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.contract import SamplingParams
from kvmem_core.draft_budget import DraftBudget, ForwardCosts
from kvmem_core.errors import ConfigError
from kvmem_core.lookup import LookupDrafter
from kvmem_core.step import ViewState, append_computed


class Verifier(Protocol):
    """What the engine lends the speculation: its view's next position and the moves that change it."""

    def room(self, n: int) -> int:
        """Make room for ``n`` more cells if the view can; -> the cells free (possibly fewer than ``n``)."""
        ...

    def run(self, tokens: Sequence[int]) -> np.ndarray:
        """Forward ``tokens`` at the view's next positions without committing them; -> float32 logits
        ``[len(tokens), vocab]``, valid until the next ``run``."""
        ...

    def commit(self, token: int) -> None:
        """The view's next position now holds ``token`` (its cell was computed by ``run``)."""
        ...

    def discard(self, keep: int) -> None:
        """Remove the cells ``run`` computed past the committed ones, all but the first ``keep``."""
        ...


class Drafter(Protocol):
    """Guesses of the next tokens: told each token the loop advances, asked for a draft before each verification."""

    def extend(self, tokens: Sequence[int]) -> None:
        """The loop advanced these tokens (the newest was just chosen; its draft is asked for next)."""
        ...

    def propose(self, limit: int | None = None) -> list[int]:
        """Up to ``limit`` tokens likely to follow the tokens so far ([] for no guess)."""
        ...


@dataclass
class DraftStats:
    """Tokens drafted and accepted in one step (``accepted <= drafted``)."""

    drafted: int = 0
    accepted: int = 0


class LookupAdvance:
    """Greedy decoding's ``Advance`` with a ``Drafter``'s drafts (prompt lookup or MTP; see module docstring)."""

    def __init__(
        self, verifier: Verifier, drafter: Drafter, max_tokens: int, budget: DraftBudget | None = None
    ) -> None:
        """``drafter``: lookup's holds the transcript; ``max_tokens``: the step's limit (no draft runs past it);
        ``budget``: how much of each draft to verify (None: all of it)."""
        self.verifier, self.drafter, self.max_tokens, self.budget = verifier, drafter, max_tokens, budget
        self.stats = DraftStats()
        self._ready: deque[tuple[int, np.ndarray]] = deque()  # accepted draft tokens not yet taken, with their logits
        self._taken = 0  # tokens the loop advanced so far

    def __call__(self, token: int) -> Callable[[], np.ndarray]:
        self._taken += 1
        self.drafter.extend([token])
        if self.budget is not None:
            self.budget.advanced(token)
        if self._ready and self._ready[0][0] == token:
            _, logits = self._ready.popleft()
            self.verifier.commit(token)
            return lambda: logits
        self.close()  # a steer forced another token than the model's (only then do accepted drafts go unused)
        return self._verify(token)

    def close(self) -> None:
        """Remove the cells of accepted draft tokens the loop did not take (it stopped first)."""
        if self._ready:
            self.verifier.discard(0)
            self._ready.clear()

    def _verify(self, token: int) -> Callable[[], np.ndarray]:
        limit = self.max_tokens - self._taken - 1  # draft tokens whose logits the loop may still sample from
        draft = self.drafter.propose(limit) if limit > 0 else []
        if self.budget is not None and draft:
            keep = self.budget.length(len(draft))
            if not keep:
                self.budget.shadow(draft)
            draft = draft[:keep]
        draft = draft[: max(0, self.verifier.room(1 + len(draft)) - 1)]
        started = time.perf_counter()
        logits = self.verifier.run([token, *draft])
        if self.budget is not None:
            self.budget.timed(1 + len(draft), started, time.perf_counter())
        self.verifier.commit(token)
        if draft:
            accepted = accepted_prefix(logits, draft)
            if self.budget is not None:
                self.budget.verified(len(draft), accepted)
            self.verifier.discard(accepted)
            self._ready.extend((draft[i], logits[i + 1]) for i in range(accepted))
            self.stats.drafted += len(draft)
            self.stats.accepted += accepted
        return lambda: logits[0]


def accepted_prefix(logits: np.ndarray, draft: Sequence[int]) -> int:
    """How many leading ``draft`` tokens greedy decoding picks itself: ``draft[i]`` is taken while it is the argmax
    of ``logits[i]`` (the logits after the token before it) and every earlier one was taken."""
    choices = np.argmax(logits[: len(draft)], axis=-1)
    wrong = np.flatnonzero(choices != np.asarray(draft))
    return int(wrong[0]) if wrong.size else len(draft)


class ViewVerifier:
    """The ``Verifier`` over an engine's view: forwards through the adapter's ``forward_every``, commits through
    ``append_computed`` (the blocks a commit completes join ``completed``), makes room through ``room``."""

    def __init__(
        self, adapter: EngineAdapter, view: ViewState, room: Callable[[int], int], completed: list[int]
    ) -> None:
        self.adapter, self.view, self.room, self.completed = adapter, view, room, completed

    def run(self, tokens: Sequence[int]) -> np.ndarray:
        start = self.view.next_pos
        return self.adapter.forward_every(tokens, list(range(start, start + len(tokens))))  # type: ignore[attr-defined]

    def commit(self, token: int) -> None:
        self.completed.extend(append_computed(self.view, [token]))

    def discard(self, keep: int) -> None:
        self.adapter.drop(self.view.next_pos + keep, -1)  # the tail is the view's last span: nothing lies past it


def speculative_advance(
    mode: str,
    adapter: EngineAdapter,
    sampling: SamplingParams,
    shaped: bool,
    history: Sequence[int] | np.ndarray,
    verifier: Callable[[], Verifier],
    costs: ForwardCosts,
) -> LookupAdvance | None:
    """The speculating ``Advance`` for a step, or None where it would not be lossless or cannot run: ``mode`` off
    (``auto``: lookup where the adapter's ``caps.cheap_drafts``, off elsewhere),
    a sampled step (temperature above 0), a step ``shaped`` by an output format, an adapter without
    ``forward_every``. ``history``: the transcript the request sent (``lookup`` drafts from it and verifies as
    much of each draft as ``costs``, the engine's timed forwards, and the step's acceptance make worth it:
    ``draft_budget``; ``mtp`` asks the adapter's ``draft_head``, which ``check_mode`` made sure it has)."""
    if mode == "auto":
        mode = "lookup" if adapter.caps.cheap_drafts else "off"
    if mode == "off" or sampling.temperature > 0 or shaped or not hasattr(adapter, "forward_every"):
        return None
    assert sampling.max_tokens is not None
    if mode == "mtp":
        return LookupAdvance(verifier(), adapter.draft_head(), sampling.max_tokens)  # type: ignore[attr-defined]
    return LookupAdvance(verifier(), LookupDrafter(history), sampling.max_tokens, DraftBudget(costs))


def check_mode(mode: str, adapter: EngineAdapter) -> None:
    """ConfigError for ``mtp`` on a model without MTP layers (at load for ``--speculative``, per request for
    ``kvmem.speculative``)."""
    if mode == "mtp" and not adapter.caps.draft_head:
        raise ConfigError(
            f"speculative mode mtp needs a model with MTP layers (mtp.* tensors, a GGUF's nextn tensors); "
            f"{adapter.model_id} has none (use lookup or off)"
        )
