"""Calibration recovers the heads planted in synthetic captures; block scores match float64; profiles round-trip."""

from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.retrieval import CalibrationDoc, RetrievalProfile, block_scores, calibrate

L, HQ, HKV, D, T, TQ, B = 3, 6, 2, 16, 200, 6, 16
PLANTED = {(1, 4), (2, 0)}
SINK_HEAD = (0, 2)


def make_doc(rng: np.random.Generator) -> CalibrationDoc:
    """Random captures (the question is the last TQ tokens); the planted heads' question queries point
    at the fact's keys, and one decoy head attends hard to token 0 (a sink head: sharp, never at the fact)."""
    q = rng.standard_normal((L, TQ, HQ, D)).astype(np.float32)
    k = rng.standard_normal((L, T + TQ, HKV, D)).astype(np.float32)
    start = int(rng.integers(B + 4, T - 12))
    fact = (start, start + 8)
    for layer, head in PLANTED:
        u = rng.standard_normal(D).astype(np.float32)
        u /= np.linalg.norm(u)
        q[layer, :, head] = 4 * u + 0.3 * rng.standard_normal((TQ, D))
        k[layer, fact[0] : fact[1], head // 3] += 3 * u
    layer, head = SINK_HEAD
    q[layer, :, head] = 5 * k[layer, 0, head // 3] / np.linalg.norm(k[layer, 0, head // 3])
    return CalibrationDoc(q, k, fact)


def test_calibration_recovers_planted_heads(tmp_path):
    rng = np.random.default_rng(5)
    docs = [make_doc(rng) for _ in range(8)]
    profile = calibrate(docs, fingerprint="fp", n_heads=2, block_tokens=B)
    assert set(profile.heads) == PLANTED
    assert (profile.n_docs, profile.n_holdout, profile.block_tokens) == (6, 2, B)
    assert profile.fit_hit_rate == profile.holdout_hit_rate == 1.0
    assert all(profile.hit_rate[f"{l}:{h}"] == 1.0 for l, h in PLANTED)
    assert profile.hit_rate["0:2"] < 0.5
    others = [v for key, v in profile.scores.items() if tuple(map(int, key.split(":"))) not in PLANTED]
    assert min(profile.scores[f"{l}:{h}"] for l, h in PLANTED) > max(others) + 1
    path = tmp_path / "profile.json"
    profile.save(path)
    assert RetrievalProfile.load(path) == profile


def test_block_scores_are_the_largest_question_token_mass_per_block():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 4 * 5 + 2 + 3, 1, 4)).astype(np.float32)  # 5 whole blocks, 2 partial, 3 question
    got = block_scores(CalibrationDoc(q, k, (6, 9)), block_tokens=4)
    assert got.gold.tolist() == [False, True, True, False, False]
    for head in range(2):
        want = np.zeros(5)
        for t in range(3):
            logits = k[0, :20, 0].astype(np.float64) @ q[0, t, head] / 2.0
            p = np.exp(logits - logits.max())
            want = np.maximum(want, (p / p.sum()).reshape(5, 4).sum(axis=1))
        np.testing.assert_allclose(got.scores[0, head], want, rtol=1e-5)


def test_a_fact_outside_the_candidate_blocks_is_skipped():
    rng = np.random.default_rng(1)
    q = rng.standard_normal((1, 3, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 25, 1, 4)).astype(np.float32)
    assert block_scores(CalibrationDoc(q, k, (1, 3)), block_tokens=4) is None  # in the sink block
    assert block_scores(CalibrationDoc(q, k, (19, 21)), block_tokens=4) is None  # reaches the partial block


def test_version_1_profiles_still_load():
    profile = RetrievalProfile.from_json(
        '{"version": 1, "fingerprint": "f", "heads": [[1, 2]], "scores": {}, "hit_rate": {}, "n_docs": 8}'
    )
    assert profile.heads == ((1, 2),) and profile.block_tokens == 0
    with pytest.raises(ValueError):
        RetrievalProfile.from_json('{"version": 9}')
