"""Summaries computed where a torch view's KV is (``kvmem_torch.staged``) checked against the host's
(``summarize_block``): the unit and the GPU tests share these."""

from __future__ import annotations

import numpy as np
import torch

from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine
from torch_tiny import random_qwen35_adapter


def assert_same_summaries(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, value in want.items():
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        assert np.allclose(got[name].astype(np.float32), value.astype(np.float32), rtol=2e-3, atol=1e-4), name


def stored_and_recomputed(device: str) -> list[tuple[dict, dict]]:
    """A torch engine's stored summaries of a 150-token prompt's blocks (the host summarizes few of them) beside the
    host's from the stored KV."""
    config = KVMemConfig(ctx=2048, budget=64, gen_budget=96, block_tokens=16, sink_tokens=16, recent_tokens=32)
    adapter = random_qwen35_adapter(device, view_tokens=config.view_tokens, block_tokens=16)
    engine = KVMemEngine(adapter, config, heads=((0, 0), (0, 3)))
    assert adapter.staged.summarizing is not None
    ids = torch.randint(0, 4000, (150,), generator=torch.Generator().manual_seed(3)).tolist()
    request = StepRequest(prompt=" ".join(map(str, ids)), sampling=SamplingParams(temperature=0.0, max_tokens=2))
    on_host = []
    host_summaries = engine._summarize
    engine._summarize = lambda kv, pos: on_host.append(pos) or host_summaries(kv, pos)
    result = engine.step(request, lambda piece: True)
    engine._summarize = host_summaries
    ws = engine.store.workspaces[result.workspace_id]
    assert len(on_host) < len(ws.hashes) // 4, "the staged blocks' summaries come from the adapter"
    loaded = engine.store.complete_load(engine.store.prepare_load(ws.hashes)).blocks
    pairs = [(engine.store.meta(h), loaded[h]) for h in ws.hashes]
    return [(meta.summary, engine._summarize(kv, meta.start_pos)) for meta, kv in pairs]
