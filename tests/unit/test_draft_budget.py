"""Lookup draft lengths from timed forwards and the step's acceptance (``kvmem_core.draft_budget``), and the
speculating decode loop's use of them, against a verifier whose forwards take the times a test gives them; and the
speculative bench's bound on what any draft lengths could gain (``kvmem_bench.speed_speculative.lookup_bound``)."""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import kvmem_core.speculative as speculative
from kvmem_core.draft_budget import FIRST_DRAFT, KNOWN_AFTER, SPIKE, Acceptance, DraftBudget, ForwardCosts
from kvmem_core.lookup import DRAFT_TOKENS, LookupDrafter
from kvmem_core.speculative import LookupAdvance
from kvmem_bench.speed_speculative import lookup_bound

# one llama.cpp thread pair on a 2-vCPU x86-64 VM, default model (ms): a batch costs nearly per token
CPU_MS = {1: 22.5, 2: 43.2, 3: 55.9, 5: 81.7, 9: 125.5, 17: 188.4, 33: 317.4}


def costs_of(ms: dict[int, float]) -> ForwardCosts:
    """Costs with each count timed as often as the budget times it before trusting it."""
    costs = ForwardCosts()
    for rows, t in ms.items():
        for _ in range(KNOWN_AFTER):
            costs.record(rows, t / 1e3)
    return costs


def budget_at(ms: dict[int, float], streak: int) -> DraftBudget:
    """A budget whose last ``streak`` draft tokens were right."""
    budget = DraftBudget(costs_of(ms))
    budget.verified(5, 2)
    budget.verified(streak, streak)
    return budget


def test_costs_interpolate_between_timed_counts_and_extend_past_them() -> None:
    ratios = costs_of({1: 10.0, 5: 30.0, 9: 40.0}).ratios(13)
    assert ratios is not None
    assert ratios[:9].tolist() == pytest.approx([1, 1.5, 2, 2.5, 3, 3.25, 3.5, 3.75, 4])
    assert ratios[12] == pytest.approx(5.0)  # the last segment's slope, 2.5 ms a token
    assert costs_of({1: 10.0, 9: 8.0}).ratios(20).tolist() == [1.0] * 20  # never below one token, never downhill


def test_costs_are_unknown_until_one_token_and_more_were_timed() -> None:
    assert costs_of({1: 10.0}).ratios(4) is None
    assert costs_of({9: 10.0}).ratios(4) is None
    assert DraftBudget(ForwardCosts()).length(20) == FIRST_DRAFT
    assert DraftBudget(ForwardCosts()).length(3) == 3
    assert DraftBudget(costs_of({FIRST_DRAFT + 1: 10.0})).length(20) == 0  # then one token is timed
    assert DraftBudget(costs_of({1: 10.0})).length(20) == FIRST_DRAFT
    unsure = costs_of({1: 10.0, FIRST_DRAFT + 1: 100.0})  # each token costs a step: no draft pays
    assert DraftBudget(unsure).length(DRAFT_TOKENS) == DRAFT_TOKENS  # but the longest is timed once
    assert DraftBudget(unsure).length(DRAFT_TOKENS - 1) == 0


def test_a_first_timing_is_checked_by_a_second_and_a_lone_spike_is_ignored() -> None:
    costs = ForwardCosts()
    costs.record(9, 0.050)  # the forward that captured a CUDA graph
    assert not costs.known(9) and DraftBudget(costs).length(20) == FIRST_DRAFT  # timed again
    costs.record(9, 0.002)
    assert costs.known(9) and costs.seconds[9] == pytest.approx(0.002)
    costs.record(9, 0.002 * SPIKE * 2)  # another capture (a new view-size bucket), a page fault
    assert costs.seconds[9] == pytest.approx(0.002)
    costs.record(9, 0.002)
    costs.record(9, 0.010)
    costs.record(9, 0.010)  # two in a row: the forward did get slower
    assert costs.seconds[9] == pytest.approx(0.002 + 0.3 * 0.008)


def test_a_new_timing_moves_the_average_part_way() -> None:
    costs = costs_of({1: 10.0, 2: 20.0})
    costs.record(2, 0.030)
    assert costs.seconds[2] == pytest.approx(0.023)


@given(st.integers(1, 200), st.integers(0, 40))
def test_expected_tokens_follow_the_rule_of_succession(streak: int, most: int) -> None:
    acceptance = Acceptance()
    acceptance.observe(streak, False)
    all_right = [(streak + 1) / (streak + 1 + j) for j in range(most + 1)]  # the next j right: a telescoping product
    assert acceptance.expected_tokens(most).tolist() == pytest.approx(np.cumsum(all_right).tolist())


@given(st.lists(st.booleans(), max_size=30), st.integers(0, 40))
def test_after_a_wrong_token_the_first_is_right_at_the_recent_rate(firsts: list[bool], most: int) -> None:
    acceptance, right, tries = Acceptance(), 0.0, 0.0
    for first in firsts:  # a try at streak 0: right (then a wrong one), or wrong
        acceptance.observe(int(first), True)
        right, tries = 0.9 * right + first, 0.9 * tries + 1
    rate = (right + 1) / (tries + 2)
    assert acceptance.streak == 0 and acceptance.first_rate == pytest.approx(rate)
    all_right = [1.0] + [rate * 2 / (1 + j) for j in range(1, most + 1)]  # then as after one right: 2 / (2 + j - 1)
    assert acceptance.expected_tokens(most).tolist() == pytest.approx(np.cumsum(all_right).tolist())


def test_free_verification_drafts_everything_offered() -> None:
    flat = {1: 10.0, 9: 10.0, 33: 10.0}
    assert budget_at(flat, 0).length(20) == 20
    assert budget_at(flat, 0).length(100) == DRAFT_TOKENS


def test_a_cpu_drafts_long_copies_and_declines_unsure_guesses() -> None:
    assert budget_at(CPU_MS, 40).length(DRAFT_TOKENS) >= 16  # a file copied back: long drafts pay
    assert budget_at(CPU_MS, 3).length(DRAFT_TOKENS) == 0  # guesses that broke lately: two tokens cost two steps
    assert budget_at({1: 10.0, 9: 90.0, 33: 330.0}, 1000).length(DRAFT_TOKENS) == 0  # each token costs a step


def test_work_outside_the_forwards_makes_drafts_worth_less() -> None:
    budget = budget_at(CPU_MS, 5)
    assert budget.length(DRAFT_TOKENS) > 0
    budget.costs.record_per_token(0.015)  # sampling and streaming a token cost 15 ms, with a draft or without
    assert budget.length(DRAFT_TOKENS) == 0


def test_the_time_between_forwards_is_billed_to_the_tokens_advanced() -> None:
    budget = DraftBudget(ForwardCosts())
    budget.timed(9, 1.0, 1.2)
    for token in (1, 2, 3):
        budget.advanced(token)
    budget.timed(1, 1.5, 1.52)
    assert budget.costs.per_token == pytest.approx(0.1)
    assert budget.costs.seconds == pytest.approx({9: 0.2, 1: 0.02})


def test_a_wrong_token_ends_the_streak() -> None:
    acceptance = Acceptance()
    acceptance.observe(7, False)
    acceptance.observe(3, False)
    assert acceptance.streak == 10
    acceptance.observe(2, True)
    assert acceptance.streak == 0


def test_a_declined_draft_counts_as_the_next_tokens_say() -> None:
    budget = DraftBudget(ForwardCosts())
    budget.shadow([5, 6, 7])
    for token, streak in ((5, 1), (6, 2), (9, 0), (7, 0)):
        budget.advanced(token)
        assert budget.acceptance.streak == streak


class TimedVerifier:
    """A view of ``vocab`` logits that always pick ``answer[i]`` at position i; a forward of n rows takes
    ``ms[n]`` (interpolated) of a clock the test reads."""

    def __init__(self, answer: Sequence[int], ms: dict[int, float], clock: list[float]) -> None:
        self.answer, self.costs, self.clock = list(answer), costs_of(ms), clock
        self.ms, self.pos, self.rows_run, self.run_at = ms, 0, [], []  # pos: committed tokens

    def room(self, n: int) -> int:
        return n

    def run(self, tokens: Sequence[int]) -> np.ndarray:
        ratios = self.costs.ratios(len(tokens))
        assert ratios is not None
        self.clock[0] += ratios[-1] * self.ms[1] / 1e3
        self.rows_run.append(len(tokens))
        self.run_at.append(self.pos)
        logits = np.zeros((len(tokens), 64), dtype=np.float32)
        for i in range(len(tokens)):
            logits[i, self.answer[self.pos + i + 1]] = 1.0
        return logits

    def commit(self, token: int) -> None:
        assert token == self.answer[self.pos]
        self.pos += 1

    def discard(self, keep: int) -> None:
        pass


def decode_all(answer: Sequence[int], history: Sequence[int], ms: dict[int, float], monkeypatch) -> TimedVerifier:
    clock = [0.0]
    monkeypatch.setattr(speculative.time, "perf_counter", lambda: clock[0])
    verifier = TimedVerifier(answer, ms, clock)
    advance = LookupAdvance(verifier, LookupDrafter(history), len(answer) - 1, DraftBudget(ForwardCosts()))
    token = answer[0]
    for i in range(len(answer) - 2):
        logits = advance(token)()
        token = int(np.argmax(logits))
        assert token == answer[i + 1]
    advance.close()
    return verifier


def test_a_copy_is_verified_in_long_drafts_where_rows_are_cheap(monkeypatch: pytest.MonkeyPatch) -> None:
    text = list(np.random.default_rng(0).integers(0, 64, 300))
    v = decode_all(text[100:], text, {1: 10.0, 33: 12.0}, monkeypatch)
    assert max(v.rows_run) == DRAFT_TOKENS + 1 and len(v.rows_run) < 30


def test_guesses_stop_where_rows_cost_and_return_when_a_copy_would_pay(monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(1)
    read, prose = (rng.integers(0, 48, n).tolist() for n in (150, 150))  # 2-gram matches in random text: mostly wrong
    v = decode_all(prose + read, read, {1: 10.0, 2: 19.0, 33: 100.0}, monkeypatch)
    in_prose = [rows for rows, at in zip(v.rows_run, v.run_at) if 30 <= at < 150]
    in_copy = [rows for rows, at in zip(v.rows_run, v.run_at) if at >= 150]
    assert sum(rows > 1 for rows in in_prose) <= 2, "wrong guesses stop being verified (a chance streak aside)"
    assert max(in_copy) > FIRST_DRAFT and len(in_copy) < 40, "the declined drafts show the copy; it is drafted again"


COPIED = list(range(10, 50))  # 40 tokens the answers below copy
HISTORY = [7, 8, *COPIED, 7, 8]  # ends with the two tokens that came before them


def test_the_bound_verifies_each_copied_run_in_one_forward_where_rows_are_free() -> None:
    # the 2-gram (7, 8) drafts COPIED[:32]: one forward of 33 rows takes those and the next token; then the newest
    # match of the last 4 tokens drafts the rest, 7 tokens in a second forward: 40 tokens in 2 forwards
    assert lookup_bound(HISTORY, COPIED, np.ones(DRAFT_TOKENS + 1)) == 20.0


def test_the_bound_is_one_where_nothing_is_drafted_or_rows_cost_per_token() -> None:
    assert lookup_bound(HISTORY, list(range(100, 140)), np.ones(DRAFT_TOKENS + 1)) == 1.0
    assert lookup_bound(HISTORY, COPIED, np.arange(1.0, DRAFT_TOKENS + 2)) == 1.0


def test_the_bound_takes_a_shorter_draft_where_a_long_one_costs_more_than_it_saves() -> None:
    # rows cost nothing up to 5, then 10 one-token forwards each: 8 forwards of 5 tokens beat any longer draft
    ratios = np.where(np.arange(1, DRAFT_TOKENS + 2) <= 5, 1.0, 10.0)
    assert lookup_bound(HISTORY, COPIED, ratios) == 5.0
