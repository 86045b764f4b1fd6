"""The speed benchmark's llama.cpp measurements on SmolLM2: decode overhead against plain llama.cpp, the
structured-output mask's cost apart from the decode step, the dense prefix-cache baseline."""

from __future__ import annotations

import numpy as np
import pytest
from model_support import small_model


@pytest.mark.llamacpp
def test_decode_overhead_compares_kvmem_with_plain_llama_cpp_on_the_same_prompt():
    pytest.importorskip("llama_cpp")
    from kvmem_bench.speed_overhead import decode_overhead

    out = decode_overhead(str(small_model()), decode_tokens=8, rounds=1)
    assert out["tokens"] == 8 and out["kvmem_tok_s"] > 0 and out["plain_tok_s"] > 0
    # The ratio is taken before the speeds are rounded to two decimals.
    assert out["decode_vs_plain"] == pytest.approx(out["kvmem_tok_s"] / out["plain_tok_s"], abs=2e-3)


@pytest.mark.llamacpp
def test_structured_cost_times_the_grammar_mask_apart_from_the_decode_step():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llguidance")
    from kvmem_bench.speed_structured import structured_cost
    from kvmem.engines import load_engine
    from kvmem_core.config import KVMemConfig

    engine = load_engine("llama.cpp", str(small_model()), KVMemConfig(ctx=2048, budget=1024, gen_budget=256))
    try:
        out = structured_cost(engine, max_tokens=32, rounds=1)
    finally:
        engine.close()
    assert (
        out["tokens"] > 0
        and out["parses"]
        and out["vocab"] == 49152
        and 0 < out["mask_ms_per_token"] < out["decode_ms_per_token"]
        and out["steps"] >= out["tokens"]
        and 0 <= out["masked_share"] <= 1
        and out["host_ms_per_token"] < out["decode_ms_per_token"]
        and out["compile_ms"] > 0
    )
    exposed = out["decode_ms_per_token"] - out["free_decode_ms_per_token"]  # what the grammar adds to a step
    assert out["exposed_ms_per_token"] == pytest.approx(exposed, abs=1e-3)
    assert out["mask_share"] == pytest.approx(exposed / out["free_decode_ms_per_token"], abs=1e-3)
    assert out["mask_alone_share"] == pytest.approx(
        out["mask_ms_per_token"] / out["free_decode_ms_per_token"], abs=1e-3
    )


@pytest.mark.llamacpp
def test_prefix_cache_baseline_prefills_only_the_suffix_and_answers_as_a_full_prefill():
    llama_cpp = pytest.importorskip("llama_cpp")
    from kvmem_bench.speed_llamacpp import _argmax, baselines, prefill_from

    path = str(small_model())
    llm = llama_cpp.Llama(path, n_ctx=256, n_batch=512, verbose=False, n_threads=1, n_threads_batch=1)
    try:
        previous = llm.tokenize(b"The survey team logged soil samples at each camp. " * 6)
        ids = previous + llm.tokenize(b" Which camp logged the most samples?", add_bos=False)
        llm.eval(ids)
        full = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy()
        assert prefill_from(llm, ids, len(previous)) > 0 and llm.n_tokens == len(ids)
        cached = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        assert _argmax(llm) == int(full.argmax()) and np.allclose(cached, full, atol=0.05)
        prefill_from(llm, ids[len(previous) :], 0)  # the floor: the suffix alone, from an empty cache
        with pytest.raises(AssertionError, match="resident"):
            prefill_from(llm, ids, len(previous))  # the cache no longer holds the previous prompt
    finally:
        llm.close()
    out = baselines(path, ids, previous, 4, {"n_threads": 1, "n_threads_batch": 1}, rounds=1)
    assert out["new_tokens"] == len(ids) - len(previous)
    assert min(out["reprefill_ttft_s"], out["prefix_ttft_s"], out["suffix_floor_s"], out["full_tok_s"]) > 0
    assert out["plain_prefill_tok_s"] == pytest.approx(out["new_tokens"] / out["suffix_floor_s"])
