"""Retrieval-heads scoring on the cores the model leaves idle while a step selects.

The core's scorer (``kvmem_core.retrieval.heads_score``) can score a head's chunks of keys on several threads;
numpy's BLAS would meanwhile start its own threads for each chunk's product, and the two kinds together
oversubscribe the cores (on two cores the threaded scoring then ran slower than one thread). So while the
threads run, BLAS keeps to one thread per call (``threadpoolctl``, imported only then).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from kvmem_core.retrieval import BlockIndex, BlockScores, QueryFeatures
from kvmem_core.retrieval.token_mass import RetrievalHeadsScorer


@dataclass(frozen=True)
class ThreadedHeadsScorer:
    """``retrieval-heads`` with ``workers`` threads per (layer, kv head); the same scores as one thread."""

    heads: tuple[tuple[int, int], ...]
    workers: int
    name: str = "retrieval-heads"

    def score(self, query: QueryFeatures, index: BlockIndex) -> BlockScores:
        scorer = RetrievalHeadsScorer(self.heads, workers=self.workers)
        if self.workers == 1:
            return scorer.score(query, index)
        with _blas().limit(limits=1, user_api="blas"):
            return scorer.score(query, index)


@functools.cache
def _blas() -> Any:
    from threadpoolctl import ThreadpoolController

    return ThreadpoolController()
