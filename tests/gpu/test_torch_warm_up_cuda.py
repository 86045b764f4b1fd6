"""``TorchAdapter.warm_up`` on a GPU: it compiles by running (the decode graph it captured is kept), and afterwards
the adapter answers exactly as a fresh one does."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from torch_tiny import random_qwen35_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
IDS = list(range(100, 300))


def first_logits(adapter) -> np.ndarray:
    return adapter.forward(IDS, list(range(len(IDS)))).logits.copy()


def test_a_warmed_up_adapter_answers_as_a_fresh_one() -> None:
    warmed, fresh = (random_qwen35_adapter("cuda", view_tokens=512, block_tokens=16) for _ in range(2))
    assert warmed.warm_up() > 0
    assert warmed.runner.graphs and warmed.runner.length == 0 and warmed.view_free() == fresh.view_free()
    assert np.array_equal(first_logits(warmed), first_logits(fresh))
    warmed.close()
    fresh.close()
