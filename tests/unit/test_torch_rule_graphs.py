"""``RuleGraphs``' bookkeeping on the CPU, which has no CUDA graphs: a shape's first call runs the rule eagerly
from the shape's own static copies of its inputs, its second tries to capture, fails, and leaves the shape eager
for good (the answers stay the rule's); at most ``MAX_SHAPES`` shapes are kept, the least recently used going
first; disabled, every call is the rule's as it is. (The replays: tests/gpu/test_torch_rule_graphs_cuda.py.)"""

from __future__ import annotations

import torch

from kvmem_torch.rule_graphs import MAX_SHAPES, RuleGraphs


def rule(q, k, v, g, beta, initial_state, batch=None):
    """A stand-in with fla's argument shapes: (out, final states), both depending on every input."""
    out = v * 2 + (q * k).sum(-1, keepdim=True) + (g * beta)[..., None]
    return out, initial_state + out.sum()


def inputs(n: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, 2, 4, generator=gen) for _ in range(3))
    g, beta = (torch.randn(1, n, 2, generator=gen) for _ in range(2))
    state = torch.randn(2, 4, 4, generator=gen)
    return q, k, v, g, beta, state.expand(1, 2, 4, 4)


def test_a_shape_that_cannot_be_captured_stays_eager_with_the_rule_s_answers(caplog) -> None:
    graphs = RuleGraphs(rule)
    for seed in range(3):
        args = inputs(5, seed)
        out, final = graphs(*args)
        ref_out, ref_final = rule(*args)
        assert torch.equal(out, ref_out) and torch.equal(final, ref_final)
        (shape,) = graphs.shapes.values()
        assert shape.captured is None and shape.failed == (seed >= 1)
        assert all(static is not x for static, x in zip(shape.inputs, args))  # the rule ran from the shape's copies
    failed = [r.getMessage() for r in caplog.records if "cannot be captured" in r.getMessage()]
    assert len(failed) == 1 and "(1, 5, 2, 4)" in failed[0]  # said once, with the shape


def test_the_least_recently_used_shape_goes_first() -> None:
    graphs = RuleGraphs(rule)
    for n in range(1, MAX_SHAPES + 1):
        graphs(*inputs(n, n))
    graphs(*inputs(1, 0))  # shape 1 used again: shape 2 is now the oldest
    graphs(*inputs(MAX_SHAPES + 1, 0))
    kept = sorted(key[2][1] for key in graphs.shapes)  # each key holds q's shape (1, n, 2, 4)
    assert len(graphs.shapes) == MAX_SHAPES and 2 not in kept and 1 in kept and MAX_SHAPES + 1 in kept


def test_disabled_graphs_keep_no_shape() -> None:
    graphs = RuleGraphs(rule)
    graphs.enabled = False
    args = inputs(3, 0)
    assert all(torch.equal(a, b) for a, b in zip(graphs(*args), rule(*args)))
    assert not graphs.shapes
