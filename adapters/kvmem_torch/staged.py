"""Staged reads: the KV of a chunk's completed blocks, taken from the view right after the chunk's forward and
handed out later (``TorchAdapter.stage_reads`` / ``read_block``), with their scoring summaries where the view is
on a GPU.

On a GPU each block is copied into page-locked memory of its own (``host_memory``: the host tier keeps it) behind
the queued work, so the host may queue the next forward before it waits. The store also needs each block's
scoring summaries (``kvmem_core.retrieval.summaries``: means of its content keys, the index heads' keys), which the
host used to compute from the copies, ~2 ms a 9B-shape block, on the critical path after a turn's last forward.
Here they are computed where the view is (on a GPU, then copied out beside the blocks), for all of a chunk's
blocks at once. Key prototypes (the ``key-direction`` scorer only) and 8-bit views stay on the host.
"""

from __future__ import annotations

import functools
from typing import Callable, Sequence

import numpy as np
import torch

from kvmem_core.layout import BlockKV
from kvmem_core.retrieval.summaries import SummaryOptions, index_pairs
from kvmem_torch.host_memory import queued_blocks, to_host_array

Summary = dict[str, np.ndarray]


class StagedBlocks:
    """The staged reads of one adapter's view, by (start position, tokens)."""

    def __init__(self) -> None:
        self.reads: dict[tuple[int, int], tuple[Callable[[], BlockKV], Callable[[], Summary] | None]] = {}
        self.summarizing: tuple[tuple[tuple[int, int], ...], int] | None = None  # index pairs, sub blocks
        self.device_summaries = True  # off: the host summarizes (an A/B: kvmem_bench/speed_ab.py)

    def stage(self, k: torch.Tensor, v: torch.Tensor, starts: Sequence[int], n_tokens: int) -> None:
        """Keep the blocks of ``k`` and ``v`` [layers, len(starts) * n_tokens, kv heads, head dim] (one run of
        ``n_tokens`` per start), and their summaries where ``summarize`` asked for them."""
        n = len(starts)
        if k.is_cuda:
            block: Callable[[int], BlockKV] = queued_blocks(k, v, n)
        else:
            block = functools.partial(_run_of, k, v, n_tokens)
        summary = None
        if self.summarizing is not None and self.device_summaries:
            summary = queued_summaries(k, n, *self.summarizing)
        staged = [
            (functools.partial(block, i), None if summary is None else functools.partial(summary, i)) for i in range(n)
        ]
        self.reads.update(((start, n_tokens), read) for start, read in zip(starts, staged))

    def take(self, start_pos: int, n_tokens: int) -> BlockKV | None:
        """A staged block's KV (waiting for its copy), forgotten here; None where none was staged."""
        staged = self.reads.pop((start_pos, n_tokens), None)
        return None if staged is None else staged[0]()

    def summary(self, start_pos: int, n_tokens: int) -> Summary | None:
        """A staged block's summaries (waiting for their copy), before ``take``; None where none were computed."""
        staged = self.reads.get((start_pos, n_tokens))
        return None if staged is None or staged[1] is None else staged[1]()

    def summarize(self, heads: Sequence[tuple[int, int]], opts: SummaryOptions, quantized: bool) -> None:
        """Summarize later stagings for these index heads and options; key prototypes and 8-bit views
        (``quantized``) stay with the host (``summarize_block``)."""
        self.summarizing = (
            None if opts.prototypes or quantized else (index_pairs(heads, opts.group_size), opts.sub_blocks)
        )

    def clear(self) -> None:
        """Forget every staged read (the view they were taken from is gone)."""
        self.reads.clear()


def block_summaries(keys: torch.Tensor, pairs: Sequence[tuple[int, int]], sub_blocks: int) -> dict[str, torch.Tensor]:
    """``summarize_block``'s summaries without prototypes for a batch of blocks' float32 content keys
    [blocks, layers, tokens, kv heads, head dim], each with a leading block axis, float16."""
    out = {
        "mean_k": keys.mean(dim=2),
        "sub_mean_k": torch.stack([run.mean(dim=2) for run in torch.tensor_split(keys, sub_blocks, dim=2)], dim=3),
    }
    if pairs:
        out["head_keys"] = torch.stack([keys[:, layer, :, kv] for layer, kv in pairs], dim=1)
    return {name: x.to(torch.float16) for name, x in out.items()}


def queued_summaries(
    k: torch.Tensor, n_blocks: int, pairs: Sequence[tuple[int, int]], sub_blocks: int
) -> Callable[[int], Summary]:
    """The summaries (``block_summaries``) of ``n_blocks`` equal runs of content keys [layers, n_blocks * n, kv
    heads, head dim], computed where they are now (on a GPU copied to page-locked memory behind the queued work).
    -> a call that waits for the copies once and returns block ``i``'s summaries as ``summarize_block`` returns
    them."""
    keys = k.float().unflatten(1, (n_blocks, -1)).movedim(1, 0)
    host = {name: x.to("cpu", non_blocking=True) for name, x in block_summaries(keys, pairs, sub_blocks).items()}
    copied = torch.cuda.Event() if k.is_cuda else None
    if copied is not None:
        copied.record()
    head_pairs = np.asarray(pairs, dtype=np.int16) if pairs else None

    def summary(i: int) -> Summary:
        if copied is not None:
            copied.synchronize()
        out = {name: x[i].numpy().copy() for name, x in host.items()}  # copies: the batch stays page-locked
        return out if head_pairs is None else {**out, "head_pairs": head_pairs.copy()}

    return summary


def _run_of(k: torch.Tensor, v: torch.Tensor, n_tokens: int, i: int) -> BlockKV:
    """Block ``i`` of a staged read on the CPU: its tokens of K and V as arrays of its own (the store keeps them)."""
    run = slice(i * n_tokens, (i + 1) * n_tokens)
    return BlockKV(np.array(to_host_array(k[:, run]), order="C"), np.array(to_host_array(v[:, run]), order="C"))
