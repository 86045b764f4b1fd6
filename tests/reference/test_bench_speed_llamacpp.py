"""The speed benchmark's llama.cpp measurements on SmolLM2: decode overhead against plain llama.cpp, the
structured-output mask's cost apart from the decode step."""
from __future__ import annotations

import pytest
from model_support import small_model


@pytest.mark.llamacpp
def test_decode_overhead_compares_kvmem_with_plain_llama_cpp_on_the_same_prompt():
    pytest.importorskip("llama_cpp")
    from kvmem.bench.speed_overhead import decode_overhead
    out = decode_overhead(str(small_model()), decode_tokens=8, rounds=1)
    assert out["tokens"] == 8 and out["kvmem_tok_s"] > 0 and out["plain_tok_s"] > 0
    # The ratio is taken before the speeds are rounded to two decimals.
    assert out["decode_vs_plain"] == pytest.approx(out["kvmem_tok_s"] / out["plain_tok_s"], abs=2e-3)


@pytest.mark.llamacpp
def test_structured_cost_times_the_grammar_mask_apart_from_the_decode_step():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llguidance")
    from kvmem.bench.speed_structured import structured_cost
    from kvmem.engines import load_engine
    from kvmem_core.config import KVMemConfig

    engine = load_engine("llama.cpp", str(small_model()), KVMemConfig(ctx=2048, budget=1024, gen_budget=256))
    try:
        out = structured_cost(engine, max_tokens=32)
    finally:
        engine.close()
    assert out["tokens"] > 0 and out["parses"] and out["vocab"] == 49152 and 0 < out["mask_ms_per_token"] < out["decode_ms_per_token"]
    assert out["mask_share"] == pytest.approx(out["mask_ms_per_token"] / out["decode_ms_per_token"], rel=0.01)
