"""``load_engine`` warms an adapter up (``WarmUp``) before the engine takes a request: the torch engine on the CPU
(SmolLM2 GGUF) is asked once, compiles nothing there, and its first step finds an empty view."""

from __future__ import annotations

import pytest
import torch
from model_support import SMALL_MODEL

from kvmem.engines import load_engine
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_torch.adapter import TorchAdapter


@pytest.mark.llamacpp  # SmolLM2's GGUF
def test_the_engine_is_warmed_up_once_before_its_first_step(monkeypatch: pytest.MonkeyPatch) -> None:
    asked: list[float] = []
    warm_up = TorchAdapter.warm_up
    monkeypatch.setattr(TorchAdapter, "warm_up", lambda self: asked.append(warm_up(self)) or asked[-1])
    torch.set_num_threads(1)
    engine = load_engine("torch", SMALL_MODEL, KVMemConfig(ctx=2048, budget=1024, gen_budget=256), device="cpu")
    try:
        assert asked == [0.0] and engine.adapter.runner.length == 0
        result = engine.step(
            StepRequest(prompt="The tests", sampling=SamplingParams(temperature=0, max_tokens=2)), lambda t: True
        )
        assert len(result.token_ids) == 2
    finally:
        engine.close()
