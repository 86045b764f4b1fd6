"""Compact positions on the torch engine: a first prompt longer than the model's trained context streams through
a small view, which is renumbered whenever its positions near the trained context. The torch adapter stages its
block reads (a chunk's blocks are archived while the next chunk computes), so a renumbering must find the
staged blocks stored first."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_torch.adapter import TorchAdapter  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model  # noqa: E402

CFG = KVMemConfig(
    budget=256, gen_budget=64, block_tokens=16, sink_tokens=16, recent_tokens=64, cpu_gb=0.05, positions="compact"
)


@pytest.fixture(scope="module")
def gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("compact") / "llama.gguf"
    write_gguf(path, tiny_hf_config("llama"), tiny_hf_model("llama", seed=3).state_dict())
    return path


@pytest.fixture
def engine(gguf: Path) -> Iterator[KVMemEngine]:
    adapter = TorchAdapter(gguf, view_tokens=CFG.view_tokens, block_tokens=16, device="cpu", progress=False)
    engine = KVMemEngine(adapter, CFG, heads=((0, 0),))
    yield engine
    engine.close()


def test_a_prompt_past_the_trained_context_streams_through_a_renumbered_view(engine: KVMemEngine) -> None:
    trained = engine.adapter.caps.trained_ctx
    ids = torch.randint(0, 160, (2 * trained + 100,), generator=torch.Generator().manual_seed(1))
    request = StepRequest(prompt=" ".join(map(str, ids.tolist())), sampling=SamplingParams(max_tokens=4))
    result = engine.step(request, lambda _: True)
    assert result.selection["position_mode"] == "compact" and result.completion_tokens == 4
    assert engine.view.next_pos < trained
    stored = engine.store.workspaces[result.workspace_id].hashes
    assert len(stored) == (result.prompt_tokens + 3) // 16  # every whole block of prompt and answer, once


def test_an_answer_without_max_tokens_stops_at_the_trained_context(engine: KVMemEngine) -> None:
    """``--ctx auto`` makes a workspace far longer than the model's context; an answer the request does not bound
    still ends at the trained context (decoding through the view, renumbered as its positions near the end)."""
    trained = engine.adapter.caps.trained_ctx
    assert engine.config.ctx > 4 * trained  # auto: what the host tier holds
    request = StepRequest(prompt="1 2 3 4 5 6 7 8", sampling=SamplingParams(temperature=0.0, max_tokens=None))
    result = engine.step(request, lambda _: True)
    assert result.finish_reason == "length" and result.completion_tokens == trained
    assert engine.view.next_pos < trained
