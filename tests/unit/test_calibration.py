"""Calibration recovers the heads planted in synthetic captures; profiles round-trip."""
from __future__ import annotations

import numpy as np
import pytest

from kvmem_core.layout import BlockLayout
from kvmem_core.retrieval import CalibrationDoc, RetrievalProfile, calibrate, head_fact_stats, model_fingerprint

L, HQ, HKV, D, T, TQ = 3, 6, 2, 16, 200, 6
PLANTED = {(1, 4), (2, 0)}
SINK_HEAD = (0, 2)


def make_doc(rng: np.random.Generator) -> CalibrationDoc:
    """Random captures; the planted heads' question queries point at the fact's keys, and one
    decoy head attends hard to token 0 (a sink head: sharp, but never at the fact)."""
    q = rng.standard_normal((L, TQ, HQ, D)).astype(np.float32)
    k = rng.standard_normal((L, T, HKV, D)).astype(np.float32)
    start = int(rng.integers(20, T - 12))
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
    docs = [make_doc(rng) for _ in range(6)]
    profile = calibrate(docs, fingerprint="fp", n_heads=2)
    assert set(profile.heads) == PLANTED
    assert profile.n_docs == 6
    assert all(profile.hit_rate[f"{l}:{h}"] == 1.0 for l, h in PLANTED)
    assert profile.hit_rate["0:2"] == 0.0
    others = [v for key, v in profile.scores.items() if tuple(map(int, key.split(":"))) not in PLANTED]
    assert min(profile.scores[f"{l}:{h}"] for l, h in PLANTED) > 5 * max(others)
    path = tmp_path / "profile.json"
    profile.save(path)
    assert RetrievalProfile.load(path) == profile


def test_fact_mass_is_softmax_mass_on_the_fact():
    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 2, 2, 4)).astype(np.float32)
    k = rng.standard_normal((1, 5, 1, 4)).astype(np.float32)
    mass, hit = head_fact_stats(CalibrationDoc(q, k, (1, 3)))
    for head in range(2):
        want = []
        for t in range(2):
            logits = k[0, :, 0].astype(np.float64) @ q[0, t, head] / 2.0
            p = np.exp(logits - logits.max())
            p /= p.sum()
            want.append(p[1:3].sum())
        assert mass[0, head] == pytest.approx(np.mean(want), abs=1e-6)
    assert hit.tolist() == [[float(p_top in (1, 2)) for p_top in top_tokens(q, k)]]


def top_tokens(q, k):
    """Per head: the token with the most softmax mass summed over question tokens."""
    out = []
    for head in range(q.shape[2]):
        total = np.zeros(k.shape[1])
        for t in range(q.shape[1]):
            logits = k[0, :, 0].astype(np.float64) @ q[0, t, head] / 2.0
            p = np.exp(logits - logits.max())
            total += p / p.sum()
        out.append(int(total.argmax()))
    return out


def test_fingerprint_depends_on_model_and_layout():
    a = BlockLayout(n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9)
    b = BlockLayout(n_layers=30, n_kv_heads=3, head_dim=64, n_heads=9, dtype="float32")
    assert model_fingerprint("m", a) == model_fingerprint("m", a)
    assert len({model_fingerprint("m", a), model_fingerprint("n", a), model_fingerprint("m", b)}) == 3
