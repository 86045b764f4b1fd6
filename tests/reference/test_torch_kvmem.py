"""KVMem over the torch adapter (SmolLM2): inside the budget the step equals the plain engine."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from model_support import small_model

GGUF = small_model()

from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_torch import create_adapter  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402

CONFIG = KVMemConfig(
    ctx=4096, budget=1024, gen_budget=256, sink_tokens=128, recent_tokens=256, retrieval_heads=((20, 3), (25, 1))
)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def engine() -> KVMemEngine:
    torch.set_num_threads(1)
    return KVMemEngine(create_adapter(str(GGUF), CONFIG, device="cpu", progress=False), CONFIG)


def plain_greedy(adapter: object, ids: list[int], n: int) -> tuple[np.ndarray, list[int]]:
    runner = Runner(adapter.model, 16, 128, cuda_graphs=False)
    logits, _ = runner.prefill(ids, list(range(len(ids))), chunk=adapter.prefill_chunk)
    first, out = logits[-1].float().numpy(), []
    while len(out) < n and not adapter.is_eog(nxt := int(logits[-1].argmax())):
        out.append(nxt)
        logits, _ = runner.forward([nxt], [len(ids) + len(out) - 1])
    return first, out


def test_step_inside_budget_equals_plain_engine(engine: KVMemEngine) -> None:
    messages = ({"role": "user", "content": "What is the capital of France?"},)
    result = engine.step(StepRequest(messages=messages, sampling=GREEDY), lambda _: True)
    a = engine.adapter
    ids = a.tokenize(a.render_chat(list(messages)))
    first, tokens = plain_greedy(a, ids, GREEDY.max_tokens)
    assert np.array_equal(engine.last_logits, first)
    assert list(result.token_ids[: len(tokens)]) == tokens and "Paris" in result.text


def test_next_turn_reuses_the_stored_prefix(engine: KVMemEngine) -> None:
    first = ({"role": "user", "content": "What is the capital of France?"},)
    r1 = engine.step(StepRequest(messages=first, sampling=GREEDY), lambda _: True)
    turn2 = first + ({"role": "assistant", "content": r1.text}, {"role": "user", "content": "And of Germany?"})
    r2 = engine.step(StepRequest(messages=turn2, sampling=GREEDY), lambda _: True)
    assert r2.cached_tokens > 0 and "Berlin" in r2.text
