"""Retrieval: block summaries, scorers, the budget selector and head calibration.

A step builds ``QueryFeatures`` from the query span, keeps a ``BlockIndex`` of its
workspace's summaries in sync, scores it with ``make_scorer(config.scorer, ...)`` and turns
the scores into a chronological ``Selection`` with ``Selector.select``.
"""

from __future__ import annotations

from kvmem_core.retrieval.base import BlockScores, KeySource, QueryFeatures, Scorer
from kvmem_core.retrieval.calibration import CalibrationDoc, block_scores, calibrate
from kvmem_core.retrieval.index import BlockIndex, MissingSummaryError
from kvmem_core.retrieval.profile import RetrievalProfile
from kvmem_core.retrieval.scorers import KeyDirectionScorer, MeanKScorer, SubBlockMeanKScorer, make_scorer
from kvmem_core.retrieval.selector import ATOMIC_PREFIX, MANDATORY_TAG, BlockSpans, Selection, Selector, StoredSpans
from kvmem_core.retrieval.summaries import SummaryOptions, index_pairs, summarize_block
from kvmem_core.retrieval.token_mass import PerTokenScorer, RetrievalHeadsScorer

__all__ = [
    "ATOMIC_PREFIX",
    "BlockIndex",
    "BlockScores",
    "BlockSpans",
    "StoredSpans",
    "CalibrationDoc",
    "KeyDirectionScorer",
    "KeySource",
    "MANDATORY_TAG",
    "MeanKScorer",
    "MissingSummaryError",
    "PerTokenScorer",
    "QueryFeatures",
    "RetrievalHeadsScorer",
    "RetrievalProfile",
    "Scorer",
    "Selection",
    "Selector",
    "SubBlockMeanKScorer",
    "SummaryOptions",
    "calibrate",
    "block_scores",
    "index_pairs",
    "make_scorer",
    "summarize_block",
]
