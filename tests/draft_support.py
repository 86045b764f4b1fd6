"""Speculative-decoding tests that check what verification keeps, not which drafts are worth verifying."""

from __future__ import annotations

from kvmem_core.draft_budget import FIRST_DRAFT, KNOWN_AFTER, ForwardCosts
from kvmem_core.engine import KVMemEngine
from kvmem_core.lookup import DRAFT_TOKENS


class FlatCosts(ForwardCosts):
    """Forwards of any row count cost the same and timings change nothing: the budget verifies each draft whole
    (``tests/unit/test_draft_budget.py`` checks its choices)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = {1: 1.0, FIRST_DRAFT + 1: 1.0, DRAFT_TOKENS + 1: 1.0}
        self.timings.update({rows: KNOWN_AFTER for rows in self.seconds})

    def record(self, rows: int, seconds: float) -> None:
        pass


def verify_every_draft(engine: KVMemEngine) -> KVMemEngine:
    engine.forward_costs = FlatCosts()
    return engine
