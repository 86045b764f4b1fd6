"""Page-locked host arrays for blocks moving between the host tier and a GPU view.

Page-locked memory moves at the copy engines' rate: on the H200, 53 GB/s host -> device against 6.7 GB/s
from pageable memory, which reaches the device only through a host-side copy into a pinned buffer first.
torch's pinned allocator rounds every request up to a power of two (a host tier could lose up to half its
bytes to rounding), so the arrays here are plain numpy memory of the exact size, registered with CUDA
(``cudaHostRegister``) and unregistered when the last array viewing them is freed. Where registration
fails (a locked-memory limit), an array stays pageable: every copy still works, at the staged rate.

Whoever queues an asynchronous copy from or into such an array keeps a reference to it until the copy has
completed (``BlockStager``; staged reads wait for theirs before handing blocks out): freeing unregisters it.

Locking costs the host ~1 ms per 2 MiB block, and while the driver locks pages, on any thread, other threads'
copies and launches wait. Neither way of moving that cost off the turn measured faster than this one
registration a block (docs/benchmarks.md, 2026-12-06): a pool of pinned slabs locked ahead by a background thread
(its ``cudaHostAlloc`` held the main thread's copies 32 ms a slab), and a pageable host tier behind a fixed pinned
staging area (each block copied once more on the host, and blocks going back into a view through the ring).
"""

from __future__ import annotations

import weakref
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


def queued_blocks(k: torch.Tensor, v: torch.Tensor, n_blocks: int) -> Callable[[int], BlockKV]:
    """Copies of ``n_blocks`` equal runs of K and V [layers, n_blocks * n, kv heads, head dim] on a GPU into
    page-locked arrays of each block's own, queued on the current stream now. -> a call that waits for the
    copies once and returns block ``i``'s K and V [layers, n, kv heads, head dim]."""
    both = torch.stack((k, v)).unflatten(2, (n_blocks, -1)).movedim(2, 0).contiguous()  # [blocks, 2, layers, n, ..]
    dtype = to_host_array(torch.empty(0, dtype=both.dtype)).dtype
    blocks = [locked_empty(tuple(both.shape[1:]), dtype) for _ in range(n_blocks)]
    for host, dev in zip(blocks, both):
        host_tensor(host).copy_(dev, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()

    def block(i: int) -> BlockKV:
        copied.synchronize()
        return BlockKV(blocks[i][0], blocks[i][1])

    return block
