"""Sampling filters, seeded draws and stop-string matching."""
from __future__ import annotations

import math

import torch

from kvmem_core.contract import SamplingParams
from kvmem_torch.sampling import Sampler, StopMatcher, filter_logits


def test_greedy_takes_the_argmax() -> None:
    logits = torch.tensor([0.1, 3.0, 2.9, -1.0])
    assert Sampler(SamplingParams(temperature=0.0))(logits) == 1


def test_top_k_keeps_exactly_k() -> None:
    out = filter_logits(torch.tensor([1.0, 4.0, 3.0, 2.0, 0.0]), top_k=2, top_p=1.0)
    assert torch.isfinite(out).tolist() == [False, True, True, False, False]


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    out = filter_logits(probs.log(), top_k=0, top_p=0.7)
    assert torch.isfinite(out).tolist() == [True, True, False, False]
    out = filter_logits(probs.log(), top_k=0, top_p=0.5)
    assert torch.isfinite(out).tolist() == [True, False, False, False]


def test_seed_reproduces_and_distribution_follows_temperature() -> None:
    logits = torch.tensor([0.0, math.log(3.0)])
    params = SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=123)
    s1, s2 = Sampler(params), Sampler(params)
    draws = [s1(logits) for _ in range(4000)]
    assert draws[:50] == [s2(logits) for _ in range(50)]
    assert 0.72 < sum(draws) / 4000 < 0.78  # p(token 1) = 3/4


def test_stop_matcher_holds_back_partial_stops_and_cuts_at_the_stop() -> None:
    m = StopMatcher(["</end>", "STOP"])
    assert m.feed("hello </e") == ("hello ", False)
    assert m.feed("nx") == ("</enx", False)
    assert m.feed(" more ST") == (" more ", False)
    assert m.feed("OP tail") == ("", True)
    m2 = StopMatcher(["\n\n"])
    assert m2.feed("a\n") == ("a", False)
    assert m2.feed("b") == ("\nb", False)
    assert m2.flush() == ""
    m3 = StopMatcher([])
    assert m3.feed("x") == ("x", False)
