"""How many lookup draft tokens a verification should carry: the count that gives the most tokens per second.

A verification of ``n`` rows costs what this engine's forwards of ``n`` tokens have cost (``ForwardCosts``, measured
on its own steps and kept across them: a one-thread CPU pays nearly per token, a GPU's memory-bound forward nearly
nothing per token, a CUDA graph's decode step far less than an uncaptured forward). A forward that also captured a
CUDA graph or paid another one-off cost would tell the budget that drafts never pay, and a declined draft is never
timed again, so each count's first timing is checked by a second and a lone spike is ignored. It yields the tokens
of the draft that greedy decoding accepts plus the model's own next one, expected from how many draft tokens in a
row were right lately (``Acceptance``). A draft is verified only where that beats plain decoding by ``MARGIN``. The
streak also counts drafts that were not verified: a declined draft is checked against the tokens the model then
chose, for free, so a step that stopped drafting sees when copying pays again.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np

from kvmem_core.lookup import DRAFT_TOKENS

FIRST_DRAFT = 8  # the draft that times a forward of more than one token
MARGIN = 0.05  # a draft must promise this much more than plain decoding: the estimates are noisy
SMOOTHING = 0.3  # weight of a new timing in its row count's running average
KNOWN_AFTER = 2  # timings of a count before it is known: the smaller of the first two stands
SPIKE = 4.0  # a timing this many times a count's estimate is a one-off, unless the next one is too
FIRST_DECAY = 0.9  # per try: the first-token rate follows the last ten or so tries


class ForwardCosts:
    """Seconds per forward by row count, each a running average of the forwards timed (an engine's, kept across
    its steps). Counts not timed interpolate linearly between timed ones, and past the largest along the line
    through the two largest (never downhill: more tokens never cost less)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.timings: Counter[int] = Counter()  # forwards timed by row count
        self.per_token = 0.0  # seconds a decoded token costs outside forwards (sampling, text, callbacks)
        self._spiked: set[int] = set()  # counts whose last timing was ignored as a one-off

    def known(self, rows: int) -> bool:
        """Whether forwards of ``rows`` were timed often enough to trust (``KNOWN_AFTER``)."""
        return self.timings[rows] >= KNOWN_AFTER

    def record(self, rows: int, seconds: float) -> None:
        """A forward of ``rows`` took ``seconds``: the smaller of a count's first two timings stands, later ones
        move the average part way, and one over ``SPIKE`` times the average counts only if the next one is too."""
        old, before = self.seconds.get(rows), self.timings[rows]
        self.timings[rows] += 1
        if old is not None and before >= KNOWN_AFTER and seconds > SPIKE * old and rows not in self._spiked:
            self._spiked.add(rows)
            return
        self._spiked.discard(rows)
        self.seconds[rows] = min(old, seconds) if old is not None and before < KNOWN_AFTER else _averaged(old, seconds)

    def record_per_token(self, seconds: float) -> None:
        self.per_token = _averaged(self.per_token or None, seconds)

    def ratios(self, most: int) -> np.ndarray | None:
        """Cost of a forward of 1, 2, ..., ``most`` tokens in one-token forwards (at least 1 each); None until one
        token and more were timed."""
        known = sorted(self.seconds)
        if len(known) < 2 or known[0] != 1:
            return None
        xs, ys = np.array(known, dtype=np.float64), np.array([self.seconds[n] for n in known])
        rows = np.arange(1, most + 1, dtype=np.float64)
        cost = np.interp(rows, xs, ys)
        past = rows > xs[-1]
        cost[past] = ys[-1] + max(ys[-1] - ys[-2], 0.0) * (rows[past] - xs[-1]) / (xs[-1] - xs[-2])
        return np.maximum(cost / ys[0], 1.0)


def _averaged(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


class Acceptance:
    """How likely the next draft tokens are right, by the rule of succession over the current streak: the draft
    tokens right in a row since the last wrong one (verified, or checked as a shadow). After ``s > 0`` right, the
    next ``j`` are all right with probability ``(s + 1) / (s + 1 + j)``; after a wrong one, the first is right at
    the rate first tokens after wrong ones were lately (``first_rate``: prose guesses are mostly wrong, a copy's
    right once it resumes), and the rest as after one right. Copies run in long streaks, prose guesses break."""

    def __init__(self) -> None:
        self.streak = 0
        self.first_right = self.first_tries = 0.0  # first tokens after a wrong one, decaying by FIRST_DECAY a try

    @property
    def first_rate(self) -> float:
        return (self.first_right + 1) / (self.first_tries + 2)

    def observe(self, right: int, wrong: bool) -> None:
        """``right`` draft tokens were right in a row, then one wrong (``wrong``) or the draft ended."""
        if self.streak == 0 and (right or wrong):
            self.first_right = FIRST_DECAY * self.first_right + (right > 0)
            self.first_tries = FIRST_DECAY * self.first_tries + 1
        self.streak = 0 if wrong else self.streak + right

    def expected_tokens(self, most: int) -> np.ndarray:
        """Tokens a verification of a draft of 0, 1, ..., ``most`` tokens yields: its accepted prefix and the
        model's own next token."""
        j = np.arange(1, most + 1, dtype=np.float64)
        s = self.streak + 1
        all_right = s / (s + j) if self.streak else self.first_rate * 2 / (1 + j)
        return np.concatenate(([1.0], 1.0 + np.cumsum(all_right)))


class DraftBudget:
    """The draft length of each verification of one step (``length``) from the engine's ``ForwardCosts`` and the
    step's ``Acceptance``; ``timed``, ``verified`` and ``shadow``/``advanced`` keep them current."""

    def __init__(self, costs: ForwardCosts, longest: int = DRAFT_TOKENS) -> None:
        self.costs, self.longest, self.acceptance = costs, longest, Acceptance()
        self._shadow: list[int] = []  # a declined draft, checked against the tokens that follow
        self._last_end: float | None = None  # when the last forward ended
        self._advanced = 0  # tokens advanced since

    def length(self, available: int) -> int:
        """Draft tokens to verify of the ``available`` proposed: the count with the most tokens per second, counting
        each token's cost outside the forwards (``ForwardCosts.per_token``), 0 where none beats plain decoding by
        ``MARGIN``. Forwards of ``FIRST_DRAFT + 1``, 1 and ``longest + 1`` rows are timed first, each at its chances
        until it is ``known`` (a copy offers a draft at every token; the longest shows how a batch's cost grows)."""
        available, costs = min(available, self.longest), self.costs
        if not costs.known(FIRST_DRAFT + 1):
            return min(available, FIRST_DRAFT)
        if not costs.known(1):
            return 0
        if not costs.known(self.longest + 1) and available == self.longest:
            return available
        ratios = costs.ratios(available + 1)
        assert ratios is not None
        over = costs.per_token / costs.seconds[1]  # in one-token forwards
        expected = self.acceptance.expected_tokens(available)[1:]
        gain = expected * (1 + over) / (ratios[1:] + expected * over)  # a draft of 1, 2, ..., available tokens
        best = int(np.argmax(gain))
        return best + 1 if gain[best] > 1 + MARGIN else 0

    def timed(self, rows: int, started: float, ended: float) -> None:
        """A forward of ``rows`` ran from ``started`` to ``ended`` (``time.perf_counter``): its cost, and the time
        since the last one ended per token advanced meanwhile."""
        self.costs.record(rows, ended - started)
        if self._last_end is not None and self._advanced:
            self.costs.record_per_token((started - self._last_end) / self._advanced)
        self._last_end, self._advanced = ended, 0

    def verified(self, drafted: int, accepted: int) -> None:
        self.acceptance.observe(accepted, accepted < drafted)
        self._shadow = []  # the tokens it covered are counted

    def shadow(self, draft: Sequence[int]) -> None:
        """A draft that was not verified: the next tokens tell whether it would have been accepted."""
        self._shadow = list(draft)

    def advanced(self, token: int) -> None:
        """The loop took ``token``: a shadow draft's next token is right or the shadow ends wrong."""
        self._advanced += 1
        if not self._shadow:
            return
        if token == self._shadow[0]:
            self.acceptance.observe(1, False)
            self._shadow.pop(0)
        else:
            self.acceptance.observe(0, True)
            self._shadow = []
