"""Page-locked host arrays (``kvmem_torch.host_memory``): blocks a GPU view archives land in page-locked memory
(registered arrays of their exact size), go back into a view by a direct copy, and a registered array is
unregistered once the last view of it is freed."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvmem_core.adapter import Placement
from kvmem_torch import host_memory
from torch_tiny import random_qwen35_adapter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
B = 16


def test_a_locked_array_is_exactly_sized_pinned_and_unregistered_when_its_last_view_goes(monkeypatch) -> None:
    freed: list[int] = []
    monkeypatch.setattr(host_memory, "_unregister", freed.append)
    a = host_memory.locked_empty((3, 5, 7), np.dtype(np.uint16))
    assert a.shape == (3, 5, 7) and a.dtype == np.uint16 and a.base.nbytes == a.nbytes
    assert torch.from_numpy(a.view(np.int16)).is_pinned()
    ptr, view = a.ctypes.data, a[1]
    del a
    gc.collect()
    assert not freed  # a view still uses the memory
    del view
    gc.collect()
    assert freed == [ptr]


def test_staged_blocks_are_locked_and_go_back_into_a_view_by_a_direct_copy() -> None:
    adapter = random_qwen35_adapter("cuda", view_tokens=256, block_tokens=B)
    ids = torch.randint(0, 4000, (64,), generator=torch.Generator().manual_seed(2)).tolist()
    adapter.forward(ids, list(range(64)), want_logits=False)
    starts = [0, 16, 32, 48]
    expected = [adapter.read_block(p, B) for p in starts]
    adapter.stage_reads(starts, B)
    staged = [adapter.read_block(p, B) for p in starts]
    for got, want in zip(staged, expected):
        assert torch.from_numpy(got.k.view(np.int16)).is_pinned() and got.k.flags.c_contiguous
        assert np.array_equal(got.k, want.k) and np.array_equal(got.v, want.v)
    adapter.clear_view()
    adapter.write_blocks([Placement(kv, p, p) for kv, p in zip(staged, starts)])
    assert [len(blocks) for _, blocks in adapter.stager.in_flight] == [len(starts)]  # one direct batch, no ring
    for p, want in zip(starts, expected):
        back = adapter.read_block(p, B)
        assert np.array_equal(back.k, want.k) and np.array_equal(back.v, want.v)
