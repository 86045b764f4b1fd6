"""Block writes host -> device on a copy stream, so staging overlaps compute.

A block's K and V for every layer are one contiguous region of the paged cache. A whole block
in page-locked host memory (``host_memory``: what a GPU view archived) is copied straight from
there, kept referenced until its copy has completed; any other block is first copied into one
of a ring of pinned buffers of the same shape. ``wait`` orders later compute after the pending
copies without blocking the host. On CPU, writes are plain copies.
"""

from __future__ import annotations

from typing import Sequence

import torch

from kvmem_torch.paged import PagedKV

Block = tuple[torch.Tensor, torch.Tensor, Sequence[int]]  # K, V [layers, n, kv heads, head dim], positions


class BlockStager:
    """A ring of pinned [2, layers, B, kv heads, head dim] buffers feeding a copy stream."""

    def __init__(self, cache: PagedKV, n_buffers: int = 8) -> None:
        self.cuda = cache.kv.is_cuda
        if not self.cuda:
            return
        shape = cache.kv.shape[1:]
        self.buffers = [torch.empty(shape, dtype=cache.kv.dtype, pin_memory=True) for _ in range(n_buffers)]
        self.done: list[torch.cuda.Event | None] = [None] * n_buffers
        self.stream = torch.cuda.Stream()
        self.next = 0
        self.in_flight: list[tuple[torch.cuda.Event, list[Block]]] = []  # direct copies and their sources

    def put(self, runner: "Runner", blocks: Sequence[Block]) -> None:  # noqa: F821
        """Insert blocks (host K/V [layers, n, kv, hd] and their positions) into ``runner``'s view."""
        if not self.cuda:
            runner.insert_blocks(blocks)
            return
        full, locked, staged = self.buffers[0].shape[2], [], []
        for b in blocks:
            (locked if b[0].shape[1] == full and b[0].is_pinned() and b[1].is_pinned() else staged).append(b)
        if locked:
            self._put_locked(runner, locked)
        for k, v, positions in staged:
            self._put_staged(runner, k, v, positions)

    def _put_locked(self, runner: "Runner", blocks: list[Block]) -> None:  # noqa: F821
        """Copy whole page-locked blocks straight from host memory; their sources stay referenced until done."""
        self._release_done()
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            runner.insert_blocks(blocks)
            done = torch.cuda.Event()
            done.record(self.stream)
        self.in_flight.append((done, blocks))

    def _put_staged(self, runner: "Runner", k: torch.Tensor, v: torch.Tensor, positions: Sequence[int]) -> None:  # noqa: F821
        i, n = self.next, k.shape[1]
        self.next = (i + 1) % len(self.buffers)
        if self.done[i] is not None:
            self.done[i].synchronize()  # the buffer's previous copy must have left it
        buf = self.buffers[i]
        buf[0, :, :n].copy_(k)
        buf[1, :, :n].copy_(v)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            runner.insert_block(buf[0], buf[1], positions)
            self.done[i] = torch.cuda.Event()
            self.done[i].record(self.stream)

    def wait(self) -> None:
        """Make the compute stream wait for every copy issued so far (the host does not block)."""
        if self.cuda:
            torch.cuda.current_stream().wait_stream(self.stream)
            self._release_done()

    def _release_done(self) -> None:
        """Drop the sources of direct copies that have completed (the host tier may free them now)."""
        while self.in_flight and self.in_flight[0][0].query():
            self.in_flight.pop(0)
