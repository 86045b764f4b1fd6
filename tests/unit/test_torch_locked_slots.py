"""``LockedSlots``' bookkeeping on the CPU, its slabs from plain memory (page-locking is CUDA's:
tests/gpu/test_torch_host_memory_cuda.py): slots are disjoint, come back only after their last view is gone, and the
pool is kept ahead of the largest take."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import torch

from kvmem_torch.host_memory import LockedSlots, slot_array

SLOT, SLAB = 96, 1024  # ten slots a slab, 64 bytes left over


def plain_slab(nbytes: int) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8)


@pytest.fixture
def pool():
    slots = LockedSlots(SLOT, SLAB, alloc=plain_slab)
    yield slots
    slots.close()


def settle(pool: LockedSlots) -> None:
    """Wait for the background top-up started by the last take."""
    pool._filler.submit(lambda: None).result()


def spans(arrays) -> list[tuple[int, int]]:
    return sorted((a.ctypes.data, a.ctypes.data + a.nbytes) for a in arrays)


def test_slots_are_disjoint_whole_and_shaped_as_asked(pool):
    taken = pool.take(13)  # more than a slab: the second is carved at once
    assert all(a.dtype == np.uint8 and a.shape == (SLOT,) for a in taken)
    edges = spans(taken)
    assert all(end <= start for (_, end), (start, _) in zip(edges, edges[1:]))
    block = slot_array(taken[0], (2, 3, 4), np.dtype(np.uint16))
    assert block.shape == (2, 3, 4) and block.flags.c_contiguous and block.ctypes.data == taken[0].ctypes.data
    block[...] = 7
    assert (taken[0][: block.nbytes].view(np.uint16) == 7).all()


def test_the_pool_is_topped_up_to_the_largest_take_in_the_background(pool):
    pool.take(4)
    settle(pool)
    assert len(pool.free) >= 4
    waiting = {t.data_ptr() for t in pool.free}
    again = pool.take(4)  # served from the pool
    assert {a.ctypes.data for a in again} <= waiting
    settle(pool)
    assert len(pool.free) >= pool.reserve == 4


def test_a_slot_comes_back_only_after_its_last_view_is_gone(pool):
    slot, *_ = pool.take(10)
    settle(pool)
    ptr, before = slot.ctypes.data, len(pool.free)
    tensor = torch.from_numpy(slot_array(slot, (8,), np.dtype(np.int32))[2:])
    del slot, _
    gc.collect()
    assert ptr not in {t.data_ptr() for t in pool.free}
    del tensor
    gc.collect()
    assert ptr in {t.data_ptr() for t in pool.free} and len(pool.free) == before + 10


def test_freed_slots_past_twice_the_reserve_leave_the_pool(pool):
    taken = pool.take(10)
    settle(pool)
    taken += pool.take(10)
    settle(pool)
    assert len(pool.free) == 10
    del taken
    gc.collect()
    assert len(pool.free) == 2 * pool.reserve == 20


def test_only_slots_up_to_an_eighth_of_a_slab_are_pooled():
    assert LockedSlots.fits(SLAB // 8, SLAB) and not LockedSlots.fits(SLAB // 8 + 1, SLAB)
    assert not LockedSlots.fits(0, SLAB)
