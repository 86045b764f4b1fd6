"""The EngineAdapter contract, run against every installed backend on the small test model, and KVMem's
step on top of it with each storage tier (host only, host + NVMe)."""

from __future__ import annotations

import numpy as np
import pytest
from model_support import small_model

from kvmem_core.adapter import EngineAdapter, Placement
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest

CFG = KVMemConfig(ctx=2048, budget=1024, gen_budget=256, block_tokens=32, sink_tokens=32, recent_tokens=128)
TEXT = "The lighthouse keeper wrote the tide tables by hand every evening, then climbed the stairs. " * 6


@pytest.fixture(scope="module", params=["llama.cpp", "torch"])
def adapter(request):
    pytest.importorskip("llama_cpp" if request.param == "llama.cpp" else "torch")
    from kvmem.engines import adapter_factory

    a = adapter_factory(request.param)(str(small_model()), CFG)
    yield a
    a.close()


def test_protocol_and_layout(adapter):
    assert isinstance(adapter, EngineAdapter)
    lay = adapter.layout
    assert lay.block_tokens == CFG.block_tokens and lay.n_heads % lay.n_kv_heads == 0
    assert adapter.caps.max_view_tokens >= CFG.view_tokens and adapter.caps.trained_ctx > 0
    assert adapter.fingerprint and adapter.model_id


def test_blocks_out_and_back_in_continue_the_same(adapter):
    ids = adapter.tokenize(TEXT)[:96]
    adapter.clear_view()
    adapter.forward(ids[:64], list(range(64)), want_logits=False)
    kv = [adapter.read_block(s, 32) for s in (0, 32)]
    want = adapter.forward(
        ids[64:], list(range(64, 96))
    ).logits.copy()  # same chunks as below: kernels are shape-dependent
    assert kv[0].k.shape == adapter.layout.kv_shape and kv[0].k.dtype == adapter.layout.storage_dtype
    adapter.clear_view()
    free = adapter.view_free()
    adapter.write_blocks([Placement(b, s, s) for b, s in zip(kv, (0, 32))])
    assert adapter.view_free() == free - 64
    got = adapter.forward(ids[64:], list(range(64, 96))).logits
    assert np.array_equal(got, want)
    adapter.drop(64, 96)
    assert adapter.view_free() == free - 64


def test_query_capture_and_content_keys_have_the_layout_shapes(adapter):
    ids = adapter.tokenize(TEXT)[:40]
    adapter.clear_view()
    out = adapter.forward(ids, list(range(40)), capture_from=32)
    lay = adapter.layout
    assert out.queries.shape == (lay.n_layers, 8, lay.n_heads, lay.head_dim)
    k = adapter.content_keys(adapter.read_block(0, 32).k, 0)
    assert k.shape == lay.kv_shape and k.dtype == np.float32


@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_two_turns_reuse_the_first_and_match_a_fresh_engine(adapter, tier, tmp_path):
    from kvmem_core.engine import KVMemEngine

    cfg = CFG.replace(nvme_dir=tmp_path) if tier == "nvme" else CFG
    sampling = SamplingParams(temperature=0.0, max_tokens=6)
    turn1 = ({"role": "user", "content": TEXT + "Who wrote the tables?"},)
    engine = KVMemEngine(adapter, cfg, heads=((1, 0),))
    r1 = engine.step(StepRequest(messages=turn1, sampling=sampling), lambda piece: True)
    turn2 = turn1 + ({"role": "assistant", "content": r1.text}, {"role": "user", "content": "When?"})
    r2 = engine.step(StepRequest(messages=turn2, sampling=sampling), lambda piece: True)
    assert r2.cached_tokens > r1.prompt_tokens  # the first answer is reused too
    engine.store.close()
    fresh = KVMemEngine(adapter, CFG, heads=((1, 0),))
    cold = fresh.step(StepRequest(messages=turn2, sampling=sampling), lambda piece: True)
    assert cold.cached_tokens == 0 and cold.token_ids == r2.token_ids
    fresh.store.close()
