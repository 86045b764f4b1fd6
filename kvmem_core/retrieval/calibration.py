"""Calibration: choose the (layer, query head) pairs whose attention finds a planted fact's block.

Data in, profile out. An engine renders synthetic documents with one planted fact among
same-form look-alikes and a question about it, and captures per document the pre-RoPE
queries of the question tokens and the pre-RoPE keys of every token; this module scores
every head on those captures exactly as ``retrieval-heads`` selects blocks (``heads_score``: softmax of
q·k/√d over the history's whole blocks, a block's score the largest mass one question
token gives it) and asks whether the fact's block beats every other candidate block (all
but the first, which the sink keeps in view anyway).

Heads are chosen greedily as a set: each round adds the head that makes the summed scores
of the set find the most facts (ties: the larger mean log margin of the fact's block over
the best other block). Documents are split into a fitting part and a held-out part; the
held-out hit rate of the chosen set is recorded in the profile, so a profile states how
well it transfers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvmem_core.retrieval.heads_score import HeadKeys, head_block_mass, head_rows
from kvmem_core.retrieval.profile import RetrievalProfile

MARGIN_CLIP = 5.0  # log-margin bound, so one very easy document does not decide a tie


@dataclass(frozen=True, eq=False)
class CalibrationDoc:
    """One captured document.

    ``q``: float32 [layers, question tokens, query heads, dim], the document's last tokens;
    ``k``: float32 [layers, tokens, kv heads, dim]; ``fact``: the fact's token range [start,
    end) in ``k``, before the question.
    """

    q: np.ndarray
    k: np.ndarray
    fact: tuple[int, int]

    def __post_init__(self) -> None:
        assert self.q.ndim == 4 and self.k.ndim == 4, "q and k must be 4-d"
        assert self.q.shape[0] == self.k.shape[0] and self.q.shape[3] == self.k.shape[3], "q/k layers or dims differ"
        assert self.q.shape[2] % self.k.shape[2] == 0, "query heads must group evenly over kv heads"
        assert 0 <= self.fact[0] < self.fact[1] <= self.history, f"fact range {self.fact} outside the history"

    @property
    def history(self) -> int:
        """Tokens before the question (the ones retrieval chooses from)."""
        return self.k.shape[1] - self.q.shape[1]


@dataclass(frozen=True, eq=False)
class DocScores:
    """Every head's block scores on one document [layers, heads, blocks] and which blocks hold the fact."""

    scores: np.ndarray
    gold: np.ndarray

    def margin(self, summed: np.ndarray) -> np.ndarray:
        """Log margin of the best fact block over the best other candidate, per leading index of ``summed``
        [..., blocks]."""
        cand = np.ones(summed.shape[-1], dtype=bool)
        cand[0] = False  # the sink block is always in view
        eps = 1e-12
        best_gold = np.log(summed[..., self.gold & cand].max(axis=-1) + eps)
        best_other = np.log(summed[..., ~self.gold & cand].max(axis=-1) + eps)
        return np.clip(best_gold - best_other, -MARGIN_CLIP, MARGIN_CLIP)


def block_scores(doc: CalibrationDoc, block_tokens: int) -> DocScores | None:
    """Per (layer, query head) and whole history block: the largest softmax mass one question token
    gives the block (softmax over the whole blocks' tokens). None when the fact is not in a
    candidate block (it lies in the first block or in the partial block before the question)."""
    n_layers, n_q, n_heads, dim = doc.q.shape
    n_kv, nb = doc.k.shape[2], doc.history // block_tokens
    gold = np.zeros(nb, dtype=bool)
    gold[doc.fact[0] // block_tokens : (doc.fact[1] - 1) // block_tokens + 1] = True
    if nb < 3 or not gold[1:].any() or doc.fact[1] > nb * block_tokens:
        return None
    group = n_heads // n_kv
    full = np.full(nb, block_tokens, dtype=np.int32)
    out = np.zeros((n_layers, n_heads, nb), dtype=np.float32)
    for layer, kv in np.ndindex(n_layers, n_kv):
        heads = slice(kv * group, (kv + 1) * group)
        keys = HeadKeys(doc.k[layer, : nb * block_tokens, kv].reshape(nb, block_tokens, dim), full)
        out[layer, heads] = head_block_mass(head_rows(doc.q[layer], range(n_heads)[heads]), keys, n_q).mass
    return DocScores(out, gold)


def _set_quality(docs: Sequence[DocScores], summed: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    """Per candidate: facts found (the fact's block beats every other candidate) and mean log margin."""
    margins = np.stack([d.margin(s) for d, s in zip(docs, summed)])  # [docs, candidates]
    return (margins > 0).sum(axis=0), margins.mean(axis=0)


def choose_heads(docs: Sequence[DocScores], n_heads: int) -> list[tuple[int, int]]:
    """Greedy forward selection of ``n_heads`` heads maximizing (facts found, mean margin) of their summed scores."""
    n_layers, n_q_heads = docs[0].scores.shape[:2]
    flat = [d.scores.reshape(n_layers * n_q_heads, -1) for d in docs]
    running = [np.zeros(f.shape[1], dtype=np.float32) for f in flat]
    chosen: list[int] = []
    for _ in range(min(n_heads, n_layers * n_q_heads)):
        hits, margin = _set_quality(docs, [r[None, :] + f for r, f in zip(running, flat)])
        hits[chosen] = -1
        best = int(np.lexsort((-np.arange(len(hits)), margin, hits))[-1])
        chosen.append(best)
        running = [r + f[best] for r, f in zip(running, flat)]
    return [divmod(i, n_q_heads) for i in chosen]


def set_hit_rate(docs: Sequence[DocScores], heads: Sequence[tuple[int, int]]) -> float:
    """Fraction of ``docs`` whose fact block the summed scores of ``heads`` rank first."""
    if not docs:
        return float("nan")
    summed = [sum(d.scores[l, h] for l, h in heads)[None, :] for d in docs]
    return float(_set_quality(docs, summed)[0][0] / len(docs))


def calibrate(
    docs: Sequence[CalibrationDoc], fingerprint: str, n_heads: int = 4, block_tokens: int = 64, holdout: float = 0.25
) -> RetrievalProfile:
    """Choose ``n_heads`` heads on the first ``1 - holdout`` of the usable documents and record every
    head's own hit rate and mean margin there, and the chosen set's hit rate on the rest."""
    scored = [s for s in (block_scores(d, block_tokens) for d in docs) if s is not None]
    assert len(scored) >= 2, "calibration needs at least two documents whose fact lies in a candidate block"
    n_fit = max(1, min(len(scored) - 1, round(len(scored) * (1 - holdout))))
    fit, held = scored[:n_fit], scored[n_fit:]
    heads = choose_heads(fit, n_heads)
    n_layers, n_q_heads = fit[0].scores.shape[:2]
    hits, margin = _set_quality(fit, [d.scores.reshape(n_layers * n_q_heads, -1) for d in fit])
    keys = [f"{l}:{h}" for l in range(n_layers) for h in range(n_q_heads)]
    return RetrievalProfile(
        fingerprint=fingerprint,
        heads=tuple(heads),
        scores={k: round(float(v), 4) for k, v in zip(keys, margin)},
        hit_rate={k: round(float(v) / len(fit), 4) for k, v in zip(keys, hits)},
        n_docs=len(fit),
        block_tokens=block_tokens,
        fit_hit_rate=round(set_hit_rate(fit, heads), 4),
        holdout_hit_rate=round(set_hit_rate(held, heads), 4),
        n_holdout=len(held),
    )
