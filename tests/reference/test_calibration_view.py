"""Calibration adapts its documents to the engine's view, and says what to change when the view is too small."""

from __future__ import annotations

import pytest

from kvmem_core.config import KVMemConfig
from kvmem_core.errors import ConfigError
from llamacpp_support import model_path

pytestmark = pytest.mark.llamacpp


def adapter_with_view(budget: int, gen_budget: int, recent_tokens: int = 64):
    from kvmem_llamacpp import create_adapter

    cfg = KVMemConfig(budget=budget, gen_budget=gen_budget, sink_tokens=0, recent_tokens=recent_tokens)
    return create_adapter(str(model_path()), cfg, n_threads=1)


def test_a_view_too_small_to_calibrate_is_a_clear_error():
    from kvmem.profiles import run_calibration

    adapter = adapter_with_view(144, 16, recent_tokens=16)  # llama.cpp pads the view to 256 cells
    try:
        with pytest.raises(ConfigError, match="--kvmem-retrieval-heads"):
            run_calibration(adapter, n_docs=1)
    finally:
        adapter.close()


@pytest.mark.parametrize("target", [600, 1536])
def test_documents_are_sized_by_the_models_tokenizer(target):
    from kvmem.profiles import doc_tokens, sized_doc

    adapter = adapter_with_view(2048, 512)
    try:
        sizes = [doc_tokens(adapter, sized_doc(adapter, seed, target)) for seed in range(5)]  # every surrounding
    finally:
        adapter.close()
    assert all(0.75 * target <= n <= target for n in sizes), sizes


@pytest.mark.slow
def test_a_small_view_calibrates_on_shorter_documents():
    from kvmem.profiles import N_DOCS, N_HEADS, run_calibration

    adapter = adapter_with_view(512, 192)
    try:
        profile = run_calibration(adapter, n_docs=8)
    finally:
        adapter.close()
    assert len(profile.heads) == N_HEADS and 6 <= profile.n_docs + profile.n_holdout <= 8 and N_DOCS > 8
