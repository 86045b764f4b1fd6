"""A first step's shapes run once before any request, so that a new machine compiles its kernels at start.

Triton compiles flash-linear-attention's kernels, and this engine's own, the first time each runs: 72-89 s for the
9B shape on an H100 whose cache was empty (docs/torch.md), which the first request would otherwise wait for; later
processes on the machine read Triton's on-disk cache (1.5-1.8 s). ``warm_up`` runs what a default-view step runs:
prefill forwards of a full and of an odd length, one carrying recurrent-state snapshots (flash-linear-attention's
variable-length batch) and one capturing queries, and a decode step (on CUDA its graph is captured and kept), then
empties the view: the view and the recurrent state a step finds afterwards are fresh ones.
"""

from __future__ import annotations

import time
from typing import Any

ODD_TOKENS = 37  # a forward whose length is no multiple of 16 (Triton specializes integer arguments on that)


def warm_up(adapter: Any) -> float:
    """Run the shapes (module docstring) in ``adapter``'s empty view, then empty it. -> seconds taken"""
    t0 = time.perf_counter()
    bt, free = adapter.layout.block_tokens, adapter.view_free()
    chunk = max(1, min(adapter.prefill_chunk, free // 4 // bt * bt or free // 4))
    odd = max(1, min(ODD_TOKENS, free - 2 * chunk - 1))
    vocab = adapter.model.spec.vocab_size
    ids = [(7919 * i + 11) % vocab for i in range(2 * chunk + odd + 1)]  # which tokens changes no kernel
    pos = list(range(len(ids)))
    cuts = [(0, chunk), (chunk, 2 * chunk), (2 * chunk, 2 * chunk + odd), (2 * chunk + odd, len(ids))]
    for i, (a, b) in enumerate(cuts):
        out = adapter.forward(
            ids[a:b],
            pos[a:b],
            want_logits=i >= 2,
            capture_from=a if i == 2 else None,
            snapshot_at=[chunk // 2 + 1] if i == 0 else [],
        )
        out.logits, out.queries, out.states  # noqa: B018  waits for the copies behind the forward
    adapter.clear_view()
    return time.perf_counter() - t0
