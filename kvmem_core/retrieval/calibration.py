"""Calibration: rank (layer, query head) pairs by how well their attention finds a planted fact.

Data in, profile out. An engine renders synthetic documents with one planted fact and a
question about it, and captures per document the pre-RoPE queries of the question tokens
and the pre-RoPE keys of every token; this module scores every head on those captures the
way ``retrieval-heads`` will use it (softmax of q·k/√d over all tokens) and keeps the best.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvmem_core.retrieval.base import softmax_mass
from kvmem_core.retrieval.profile import RetrievalProfile


@dataclass(frozen=True, eq=False)
class CalibrationDoc:
    """One captured document.

    ``q``: float32 [layers, question tokens, query heads, dim]; ``k``: float32 [layers,
    tokens, kv heads, dim]; ``fact``: the fact's token range [start, end) in ``k``.
    """

    q: np.ndarray
    k: np.ndarray
    fact: tuple[int, int]

    def __post_init__(self) -> None:
        assert self.q.ndim == 4 and self.k.ndim == 4, "q and k must be 4-d"
        assert self.q.shape[0] == self.k.shape[0] and self.q.shape[3] == self.k.shape[3], "q/k layers or dims differ"
        assert self.q.shape[2] % self.k.shape[2] == 0, "query heads must group evenly over kv heads"
        assert 0 <= self.fact[0] < self.fact[1] <= self.k.shape[1], f"fact range {self.fact} outside the document"


def head_fact_stats(doc: CalibrationDoc) -> tuple[np.ndarray, np.ndarray]:
    """Per (layer, query head): attention mass on the fact averaged over question tokens, and
    whether the token with the most mass (summed over question tokens) lies in the fact.
    Both [layers, query heads]."""
    n_layers, n_q, n_heads, dim = doc.q.shape
    n_kv = doc.k.shape[2]
    group = n_heads // n_kv
    start, end = doc.fact
    mass = np.zeros((n_layers, n_heads))
    hit = np.zeros((n_layers, n_heads))
    for layer in range(n_layers):
        q = doc.q[layer].astype(np.float32).reshape(n_q, n_kv, group, dim).transpose(1, 2, 0, 3)
        k = doc.k[layer].astype(np.float32).transpose(1, 2, 0)  # [Hkv, D, T]
        att = softmax_mass(np.matmul(q * np.float32(dim**-0.5), k[:, None]))  # [Hkv, g, Tq, T]
        mass[layer] = att[..., start:end].sum(axis=-1).mean(axis=-1).reshape(n_heads)
        top = att.sum(axis=2).argmax(axis=-1).reshape(n_heads)
        hit[layer] = (top >= start) & (top < end)
    return mass, hit


def calibrate(docs: Sequence[CalibrationDoc], fingerprint: str, n_heads: int = 3) -> RetrievalProfile:
    """Score every head on ``docs`` and keep the ``n_heads`` with the most mean fact mass
    (ties: lower layer, then lower head). The profile records every head's numbers."""
    assert docs, "calibration needs at least one document"
    stats = [head_fact_stats(d) for d in docs]
    mass = np.mean([s[0] for s in stats], axis=0)
    hit = np.mean([s[1] for s in stats], axis=0)
    n_layers, n_q_heads = mass.shape
    pairs = [(layer, head) for layer in range(n_layers) for head in range(n_q_heads)]
    ranked = sorted(pairs, key=lambda p: (-mass[p], p))
    return RetrievalProfile(
        fingerprint=fingerprint,
        heads=tuple(ranked[:n_heads]),
        scores={f"{l}:{h}": round(float(mass[l, h]), 6) for l, h in pairs},
        hit_rate={f"{l}:{h}": round(float(hit[l, h]), 6) for l, h in pairs},
        n_docs=len(docs),
    )
