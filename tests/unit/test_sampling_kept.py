"""``kvmem_core.sampling.kept_probs`` against the vocabulary-wide filter it replaces (written out here as the
reference: every token's float64 probability, top-k by masking, top-p by a stable sort of the whole vocabulary):
the same kept tokens, ties at the cuts included, the same probabilities, and the same seeded draws."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.contract import SamplingParams
from kvmem_core.sampling import Sampler, kept_probs
from test_sampling import filter_probs


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    z = logits.astype(np.float64) / temperature
    if 0 < top_k < z.size:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    probs = np.exp(z - z.max())
    probs /= probs.sum()
    if top_p < 1.0:
        order = np.argsort(-probs, kind="stable")
        keep = np.cumsum(probs[order]) - probs[order] < top_p
        probs = np.where(np.isin(np.arange(z.size), order[keep]), probs, 0.0)
        probs /= probs.sum()
    return probs


def logits_with_ties(seed: int, size: int = 5000, scale: float = 3.0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    logits = (rng.standard_normal(size) * scale).astype(np.float32)
    best = np.argsort(-logits)
    logits[best[5:9]] = logits[best[5]]  # a tie across the 6th-9th best: top-k cuts through it
    logits[rng.integers(0, size, 40)] = logits[best[0]]  # ties with the best
    return logits


@pytest.mark.parametrize("temperature", [0.3, 0.8, 1.0, 2.5])
@pytest.mark.parametrize(("top_k", "top_p"), [(40, 0.95), (7, 0.5), (0, 0.95), (0, 0.999), (0, 1.0), (6000, 0.3)])
def test_the_kept_tokens_and_probabilities_are_the_vocabulary_wide_filters(temperature, top_k, top_p) -> None:
    for seed in range(3):
        logits = logits_with_ties(seed, scale=3.0 if seed else 0.05)  # seed 0: nearly flat, a deep top-p cut
        want = reference_probs(logits, temperature, top_k, top_p)
        tokens, probs = kept_probs(logits, top_k, top_p, temperature)
        assert tokens.tolist() == np.flatnonzero(want).tolist()
        assert np.allclose(probs, want[tokens], rtol=1e-12, atol=0) and np.isclose(probs.sum(), 1.0)
        assert np.allclose(filter_probs(logits.astype(np.float64) / temperature, top_k, top_p), want, rtol=1e-12)


def test_a_deep_top_p_cut_looks_past_the_first_candidates() -> None:
    logits = np.linspace(0.0, -0.01, 5000, dtype=np.float32)  # nearly flat, all distinct: the cut falls deep
    tokens, probs = kept_probs(logits, 0, 0.9)
    assert tokens.size > 64 * 16 and tokens.tolist() == np.flatnonzero(reference_probs(logits, 1.0, 0, 0.9)).tolist()
    logits[:] = 0.0  # all tied: the first candidates' ties take in the whole vocabulary at once
    assert kept_probs(logits, 0, 0.9)[0].tolist() == np.flatnonzero(reference_probs(logits, 1.0, 0, 0.9)).tolist()


def test_seeded_draws_are_the_reference_distributions_draws() -> None:
    logits = logits_with_ties(7)
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=11)
    want = reference_probs(logits, 0.8, 40, 0.95)
    rng, sample = np.random.default_rng(11), Sampler(params)
    assert [sample(logits) for _ in range(500)] == [int(rng.choice(want.size, p=want)) for _ in range(500)]
