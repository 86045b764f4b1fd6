"""How many lookup draft tokens a verification should carry: the count that gives the most tokens per second.

A verification of ``n`` rows costs what this engine's forwards of ``n`` tokens have cost (``ForwardCosts``,
measured on its own steps and kept across them: a one-thread CPU pays nearly per token, a GPU's memory-bound
forward nearly nothing per token, a CUDA graph's decode step far less than an uncaptured forward). It yields the
tokens of the draft that greedy decoding accepts plus the model's own next one, expected from how many draft tokens
in a row were right lately (``Acceptance``). A draft is verified only where that beats plain decoding by
``MARGIN``. The streak also counts drafts that were not verified: a declined draft is checked against the tokens
the model then chose, for free, so a step that stopped drafting sees when copying pays again.
"""

from __future__ import annotations

import itertools
from typing import Sequence

from kvmem_core.lookup import DRAFT_TOKENS

FIRST_DRAFT = 8  # the draft that times a forward of more than one token
MARGIN = 0.05  # a draft must promise this much more than plain decoding: the estimates are noisy
SMOOTHING = 0.3  # weight of a new timing in its row count's running average
FIRST_DECAY = 0.9  # per try: the first-token rate follows the last ten or so tries


class ForwardCosts:
    """Seconds per forward by row count, each a running average of the forwards timed (an engine's, kept across
    its steps). Counts not timed interpolate linearly between timed ones, and past the largest along the line
    through the two largest (never downhill: more tokens never cost less)."""

    def __init__(self) -> None:
        self.seconds: dict[int, float] = {}
        self.per_token = 0.0  # seconds a decoded token costs outside forwards (sampling, text, callbacks)

    def record(self, rows: int, seconds: float) -> None:
        self.seconds[rows] = _averaged(self.seconds.get(rows), seconds)

    def record_per_token(self, seconds: float) -> None:
        self.per_token = _averaged(self.per_token or None, seconds)

    def ratios(self, most: int) -> list[float] | None:
        """Cost of a forward of 1, 2, ..., ``most`` tokens in one-token forwards (at least 1 each); None until one
        token and more were timed."""
        known = sorted(self.seconds)
        if len(known) < 2 or known[0] != 1:
            return None
        ys, one = [self.seconds[n] for n in known], self.seconds[1]
        return [max(_on_polyline(known, ys, rows) / one, 1.0) for rows in range(1, most + 1)]


def _averaged(old: float | None, new: float) -> float:
    return new if old is None else old + SMOOTHING * (new - old)


def _on_polyline(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """The piecewise-linear function through the points (ascending ``xs``, at least two) at ``x``, continued past
    the last point along the last segment's slope, or flat where that falls."""
    i = max(next((i for i, v in enumerate(xs) if v >= x), len(xs)), 1)
    if i == len(xs):
        return ys[-1] + max(ys[-1] - ys[-2], 0.0) * (x - xs[-1]) / (xs[-1] - xs[-2])
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


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

    def expected_tokens(self, most: int) -> list[float]:
        """Tokens a verification of a draft of 0, 1, ..., ``most`` tokens yields: its accepted prefix and the
        model's own next token."""
        if self.streak:
            s = self.streak + 1
            all_right = (s / (s + j) for j in range(1, most + 1))
        else:
            all_right = (self.first_rate * 2 / (1 + j) for j in range(1, most + 1))
        return list(itertools.accumulate(all_right, initial=1.0))


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
        ``MARGIN``. Forwards of ``FIRST_DRAFT + 1``, 1 and ``longest + 1`` rows are timed first, each at its first
        chance (a copy offers a draft at every token; the longest shows how a batch's cost grows)."""
        available, timed = min(available, self.longest), self.costs.seconds
        if FIRST_DRAFT + 1 not in timed:
            return min(available, FIRST_DRAFT)
        if 1 not in timed:
            return 0
        if self.longest + 1 not in timed and available == self.longest:
            return available
        ratios = self.costs.ratios(available + 1)
        assert ratios is not None
        over = self.costs.per_token / timed[1]  # in one-token forwards
        expected = self.acceptance.expected_tokens(available)
        best, best_gain = 0, 1 + MARGIN
        for k in range(1, available + 1):
            gain = expected[k] * (1 + over) / (ratios[k] + expected[k] * over)
            if gain > best_gain:
                best, best_gain = k, gain
        return best

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
