"""Page-locked host arrays for blocks moving between the host tier and a GPU view.

Page-locked memory moves at the copy engines' rate: on the H200, 53 GB/s host -> device against 6.7 GB/s
from pageable memory, which reaches the device only through a host-side copy into a pinned buffer first.
torch's pinned allocator rounds every request up to a power of two (a host tier could lose up to half its
bytes to rounding), so the arrays here are plain numpy memory of the exact size, registered with CUDA
(``cudaHostRegister``) and unregistered when the last array viewing them is freed. Where registration
fails (a locked-memory limit), an array stays pageable: every copy still works, at the staged rate.

Whoever queues an asynchronous copy from or into such an array keeps a reference to it until the copy has
completed (``BlockStager``; staged reads wait for theirs before handing blocks out): freeing unregisters it.

Locking pages costs the host ~1 ms per 2 MiB block (a 9B-shape turn archives ~44 of them), so blocks a view archives
take their memory from ``LockedSlots``: slots of one block's size carved from 64 MiB slabs of torch's pinned
allocator (a power of two: nothing rounded), which a background thread locks ahead of the next turn's need; a slot
whose last view is freed goes back to the pool.
"""

from __future__ import annotations

import collections
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np
import torch

from kvmem_core.layout import BlockKV


def to_host_array(x: torch.Tensor) -> np.ndarray:
    """Block tensor -> numpy in the host tier's storage dtype (bfloat16 as its raw uint16 bits); a copy from a GPU."""
    x = x.cpu()
    return x.view(torch.int16).numpy().view(np.uint16) if x.dtype == torch.bfloat16 else x.numpy()


def host_tensor(a: np.ndarray) -> torch.Tensor:
    """``a``'s memory as a CPU tensor (no copy): ``to_host_array``'s inverse, raw uint16 bits back as bfloat16."""
    return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) if a.dtype == np.uint16 else torch.from_numpy(a)


def locked_empty(shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """An uninitialized C-contiguous array of exactly ``shape``, page-locked when CUDA registers it."""
    owner = np.empty(int(np.prod(shape)) * np.dtype(dtype).itemsize, np.uint8)
    ptr = owner.ctypes.data
    if owner.nbytes and int(torch.cuda.cudart().cudaHostRegister(ptr, owner.nbytes, 0)) == 0:
        weakref.finalize(owner, _unregister, ptr).atexit = False  # at exit the process's mappings go anyway
    return owner.view(dtype).reshape(shape)


def _unregister(ptr: int) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)


SLAB_BYTES = 64 << 20


def pinned_slab(nbytes: int) -> torch.Tensor:
    """``nbytes`` of page-locked host memory from torch's pinned allocator (it releases the GIL meanwhile)."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


class LockedSlots:
    """Page-locked host memory for arrays of ``slot_bytes`` each, kept ahead of demand.

    ``take(n)`` hands out ``n`` slots (uint8 arrays; arrays viewing one keep it alive) and asks the background
    thread to lock slabs until as many slots as the largest ``take`` so far wait free; slots the pool lacks at a
    ``take`` are carved at once. A slot returns to the pool when the last array viewing it is freed, while fewer
    than twice that reserve wait; past that its memory goes back to the allocator with its slab. Only slots of
    at most an eighth of ``slab_bytes`` are pooled (``fits``), so a slab wastes less than one slot."""

    def __init__(
        self, slot_bytes: int, slab_bytes: int = SLAB_BYTES, alloc: Callable[[int], torch.Tensor] = pinned_slab
    ) -> None:
        assert self.fits(slot_bytes, slab_bytes)
        self.slot_bytes, self.slab_bytes, self.alloc = slot_bytes, slab_bytes, alloc
        self.free: collections.deque[torch.Tensor] = collections.deque()  # append/popleft are atomic: no lock
        self.reserve = 0
        self._filler = ThreadPoolExecutor(1, thread_name_prefix="kvmem-locked-slots")
        self._filling = threading.Event()

    @staticmethod
    def fits(slot_bytes: int, slab_bytes: int = SLAB_BYTES) -> bool:
        return 0 < slot_bytes * 8 <= slab_bytes

    def take(self, n: int) -> list[np.ndarray]:
        """``n`` slots, pooled ones first; then the pool is topped up to ``n`` free slots in the background."""
        slots: list[torch.Tensor] = []
        while len(slots) < n:
            try:
                slots.append(self.free.popleft())
            except IndexError:
                slots += self._carve()
        self.free.extendleft(slots[n:])
        self.reserve = max(self.reserve, n)
        if not self._filling.is_set():
            self._filling.set()
            self._filler.submit(self._fill)
        return [self._hand_out(slot) for slot in slots[:n]]

    def close(self) -> None:
        """Stop the background thread (slots handed out stay valid)."""
        self._filler.shutdown(wait=True)

    def _carve(self) -> list[torch.Tensor]:
        slab, size = self.alloc(self.slab_bytes), self.slot_bytes
        return [slab[i : i + size] for i in range(0, self.slab_bytes - size + 1, size)]

    def _fill(self) -> None:
        try:
            while len(self.free) < self.reserve:
                self.free.extend(self._carve())
        finally:
            self._filling.clear()

    def _hand_out(self, slot: torch.Tensor) -> np.ndarray:
        owner = _SlotOwner(slot)
        weakref.finalize(owner, self._give_back, slot).atexit = False
        return np.asarray(owner)

    def _give_back(self, slot: torch.Tensor) -> None:
        if len(self.free) < 2 * self.reserve:
            self.free.append(slot)


class _SlotOwner:
    """A slot's memory as numpy sees it: the base of every array viewing the slot, so its finalizer runs only once
    the last of them is gone (a tensor's own ``numpy()`` arrays do not keep that tensor object alive)."""

    def __init__(self, slot: torch.Tensor) -> None:
        ptr, size = slot.data_ptr(), slot.numel()
        self.__array_interface__ = {"data": (ptr, False), "shape": (size,), "typestr": "|u1", "version": 3}


def slot_array(slot: np.ndarray, shape: tuple[int, ...], dtype: np.dtype) -> np.ndarray:
    """The start of ``slot`` (a ``LockedSlots`` slot) as a C-contiguous array of ``shape`` and ``dtype``."""
    return slot[: int(np.prod(shape)) * np.dtype(dtype).itemsize].view(dtype).reshape(shape)


def queued_blocks(
    k: torch.Tensor, v: torch.Tensor, n_blocks: int, slots: LockedSlots | None = None
) -> Callable[[int], BlockKV]:
    """Copies of ``n_blocks`` equal runs of K and V [layers, n_blocks * n, kv heads, head dim] on a GPU into
    page-locked arrays of each block's own (``slots``' where given), queued on the current stream now. -> a call
    that waits for the copies once and returns block ``i``'s K and V [layers, n, kv heads, head dim]."""
    both = torch.stack((k, v)).unflatten(2, (n_blocks, -1)).movedim(2, 0).contiguous()  # [blocks, 2, layers, n, ..]
    dtype = to_host_array(torch.empty(0, dtype=both.dtype)).dtype
    shape = tuple(both.shape[1:])
    if slots is not None:
        blocks = [slot_array(slot, shape, dtype) for slot in slots.take(n_blocks)]
    else:
        blocks = [locked_empty(shape, dtype) for _ in range(n_blocks)]
    for host, dev in zip(blocks, both):
        host_tensor(host).copy_(dev, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def block(i: int) -> BlockKV:
        copied.synchronize()
        return BlockKV(blocks[i][0], blocks[i][1])

    return block
