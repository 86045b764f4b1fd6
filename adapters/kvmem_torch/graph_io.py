"""What a ``Runner``'s CUDA graphs read and write: their inputs in one device tensor sent in one copy, and a
captured forward with the outputs its replays rewrite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from kvmem_torch.model import RecurrentState

GRAPH_ARGS = ("tok", "pos", "slot", "q", "lim")  # "lim": a prefill's own rows and its snapshot offsets, then zeros


class GraphInputs:
    """A graph's inputs (token, position, slot, view index of each of its ``rows``; a prefill's limits) in one
    device tensor, sent from page-locked memory in one copy."""

    def __init__(self, rows: int, device: torch.device) -> None:
        self.dev = torch.zeros(len(GRAPH_ARGS), rows, dtype=torch.long, device=device)
        self.static = {name: self.dev[i] for i, name in enumerate(GRAPH_ARGS)}
        self._host = torch.zeros_like(self.dev, device="cpu", pin_memory=True)
        self._sent = torch.cuda.Event()  # the last copy has read _host

    def send(
        self, tokens: Sequence[int], positions: Sequence[int], slots: Sequence[int], first: int, limits: Sequence[int]
    ) -> None:
        """Queue the rows' inputs; view indices run from ``first``."""
        self._sent.synchronize()
        lim = [*limits, *[0] * (len(slots) - len(limits))]
        self._host.numpy()[:] = (tokens, positions, slots, range(first, first + len(slots)), lim)
        self.dev.copy_(self._host, non_blocking=True)
        self._sent.record()


@dataclass
class Captured:
    """A captured forward: its graph, the outputs each replay rewrites (logits; the hidden states an MTP head reads,
    or None; the captured queries by layer, or None), and the states its snapshots are written to."""

    graph: torch.cuda.CUDAGraph
    out: torch.Tensor
    hidden: torch.Tensor | None
    snapshots: tuple[RecurrentState, ...] = ()
    queries: dict[int, torch.Tensor] | None = None
