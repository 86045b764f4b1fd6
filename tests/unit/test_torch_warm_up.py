"""``kvmem_torch.warm_up`` on the CPU (tiny random qwen35; on a GPU the same runs compile the kernels:
tests/gpu/test_torch_warm_up_cuda.py): it runs forwards of every kind a step runs, and afterwards the adapter answers
exactly as a fresh one does."""

from __future__ import annotations

import numpy as np

from kvmem_torch import warm_up
from torch_tiny import random_qwen35_adapter

IDS = list(range(100, 300))


def first_logits(adapter) -> np.ndarray:
    return adapter.forward(IDS, list(range(len(IDS)))).logits.copy()


def test_the_warm_up_runs_each_kind_of_forward_and_leaves_a_fresh_view(monkeypatch):
    adapter, fresh = (random_qwen35_adapter("cpu", view_tokens=512, block_tokens=16) for _ in range(2))
    seen: list[tuple[int, bool, bool, bool]] = []
    forward = adapter.forward

    def counted(tokens, positions, **kw):
        seen.append(
            (len(tokens), kw.get("want_logits", True), kw.get("capture_from") is not None, bool(kw["snapshot_at"]))
        )
        return forward(tokens, positions, **kw)

    monkeypatch.setattr(adapter, "forward", counted)
    assert warm_up.warm_up(adapter) > 0
    monkeypatch.undo()
    assert seen == [
        (128, False, False, True),
        (128, False, False, False),
        (37, True, True, False),
        (1, True, False, False),
    ]
    assert adapter.view_free() == fresh.view_free() and adapter.runner.length == 0
    assert np.array_equal(first_logits(adapter), first_logits(fresh))
    adapter.close()
    fresh.close()


def test_an_adapter_on_the_cpu_skips_it():
    adapter = random_qwen35_adapter("cpu", view_tokens=512, block_tokens=16)
    assert adapter.warm_up() == 0.0 and adapter.runner.length == 0
    adapter.close()
