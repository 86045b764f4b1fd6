"""The speed benchmark's llama.cpp measurements on SmolLM2: decode overhead against plain llama.cpp, the
structured-output mask's cost apart from the decode step, the dense prefix-cache baseline."""

from __future__ import annotations

import time
from typing import Callable

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


def _structured_costs(max_tokens: int, rounds: int, *costs: Callable[[], None]) -> tuple[list[dict], list]:
    """``structured_cost`` on SmolLM2 once with each of ``costs`` entering every token the grammar takes; -> (the
    rows, the steps' results in order)."""
    from kvmem_bench.speed_structured import structured_cost
    from kvmem.engines import load_engine
    from kvmem_core.config import KVMemConfig
    from kvmem_core.structured import Constraint

    engine = load_engine("llama.cpp", str(small_model()), KVMemConfig(ctx=2048, budget=1024, gen_budget=256))
    results, step, take, rows = [], engine.step, Constraint.take, []
    engine.step = lambda request, on_text: results.append(step(request, on_text)) or results[-1]
    try:
        for cost in costs:

            def costly_take(self, token, data, left=None, cost=cost):
                cost()
                take(self, token, data, left)

            Constraint.take = costly_take
            rows.append(structured_cost(engine, max_tokens=max_tokens, rounds=rounds))
        return rows, results
    finally:
        Constraint.take = take
        engine.close()


def _busy(ms: float) -> Callable[[], None]:
    """A wait of ``ms`` that holds the interpreter, as the grammar's own work does."""

    def wait() -> None:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass

    return wait


@pytest.mark.llamacpp
def test_structured_cost_times_the_grammar_mask_apart_from_the_decode_step():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llguidance")
    [out], _ = _structured_costs(32, 1, lambda: None)
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
@pytest.mark.serial  # the decode and the grammar's thread each need a core of their own
def test_structured_cost_compares_the_same_model_work_and_shows_a_known_grammar_cost():
    """The free runs decode the constrained answer's own tokens and end as it does, and a known cost added to each
    token the grammar takes shows up in the exposed cost at its size, over what the grammar costs without it (a
    third of a SmolLM2 step: well above what a shared 2-vCPU machine moves the figure by, about 0.5 ms a token), in
    one of three runs."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llguidance")
    cost_ms, seen = 4.0, []
    for _ in range(3):  # a neighbour on a shared 2-vCPU machine can stretch one run's waits (5.4 ms seen once)
        (plain, costly), results = _structured_costs(32, 5, lambda: None, _busy(cost_ms))
        answer = results[0]
        assert len(results) == 22 and answer.finish_reason == "stop"  # an end token ends it, as it does the replays
        assert all(r.token_ids == answer.token_ids and r.finish_reason == "stop" for r in results)
        added = costly["exposed_ms_per_token"] - plain["exposed_ms_per_token"]
        share = costly["mask_share"] - plain["mask_share"]
        seen.append((added, share, plain, costly))
        if added == pytest.approx(cost_ms, rel=0.25) and share == pytest.approx(
            cost_ms / costly["free_decode_ms_per_token"], rel=0.3
        ):
            return
    pytest.fail(f"no run showed the added {cost_ms} ms a token at its size: {seen}")


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


@pytest.mark.llamacpp
def test_past_the_dense_limit_the_prefix_cache_runs_over_a_synthesized_history(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transcript longer than ``DENSE_MAX`` gets no re-prefill (its CPU prefill grows with the square of its
    length); its dense prefix cache holds the previous prompt's length of synthesized KV. Where that context cannot
    be made, only the floor runs, over a context of the suffix."""
    pytest.importorskip("llama_cpp")
    from kvmem_bench import speed_llamacpp

    path = str(small_model())
    previous = list(range(1000, 1100))
    ids = previous + list(range(2000, 2030))
    opts = {"n_threads": 1, "n_threads_batch": 1}
    monkeypatch.setattr(speed_llamacpp, "DENSE_MAX", len(ids) - 1)
    monkeypatch.setattr(speed_llamacpp, "SEED_TOKENS", 16)
    out = speed_llamacpp.baselines(path, ids, previous, 4, opts, rounds=1)
    assert out["reprefill_ttft_s"] is out["full_tok_s"] is None and out["prefix_cache"] == "resident, synthesized"
    assert out["new_tokens"] == 30 and out["suffix_floor_s"] > 0 and out["prefix_ttft_s"] > 0
    made = speed_llamacpp._context

    def small_only(model_path: str, n_ctx: int, opts: dict) -> object:
        if n_ctx > len(ids) - len(previous) + 68:  # the suffix, the answer and the margin fit; the whole does not
            raise ValueError("Failed to create llama_context")
        return made(model_path, n_ctx, opts)

    monkeypatch.setattr(speed_llamacpp, "_context", small_only)
    out = speed_llamacpp.baselines(path, ids, previous, 4, opts, rounds=1)
    assert out["prefix_ttft_s"] is None and out["prefix_cache"].startswith("does not fit")
    assert out["suffix_floor_s"] > 0


@pytest.mark.llamacpp
def test_a_synthesized_history_repeats_the_computed_cells_at_every_position() -> None:
    """``fill_sequence`` to the seed's own length restores the same cells (the next token's logits as after the
    real prefill); to a longer one it holds a cell at every position up to it, and a suffix decodes after them."""
    llama_cpp = pytest.importorskip("llama_cpp")
    from kvmem_bench.speed_llamacpp import _argmax, prefill_from, synthesize_prefix

    llm = llama_cpp.Llama(str(small_model()), n_ctx=512, n_batch=512, verbose=False, n_threads=1, n_threads_batch=1)
    try:
        ids = llm.tokenize(b"The survey team logged soil samples at each camp. " * 8)
        mem, n = llama_cpp.llama_get_memory(llm._ctx.ctx), len(ids) - 1
        prefill_from(llm, ids, 0)
        want = (
            _argmax(llm),
            np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),)).copy(),
        )
        synthesize_prefix(llm, ids, n)  # the seed is all of them: the same cells written back
        prefill_from(llm, ids, n)
        got = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
        assert _argmax(llm) == want[0] and np.allclose(got, want[1], atol=1e-3)
        llm.eval(ids[:16])  # a 16-cell seed repeated to 400 positions
        from kvmem_llamacpp import fill_sequence

        fill_sequence(llm._ctx.ctx, 0, 400)
        assert (llama_cpp.llama_memory_seq_pos_min(mem, 0), llama_cpp.llama_memory_seq_pos_max(mem, 0)) == (0, 399)
        llm.n_tokens = 400
        llm.eval(ids[:20])
        assert llama_cpp.llama_memory_seq_pos_max(mem, 0) == 419
    finally:
        llm.close()


def test_default_knobs_and_sizes_pick_the_full_plan_s_view_and_replace_its_sizes() -> None:
    from kvmem_bench.speed_llamacpp import FULL, QUICK, resolve_plan
    from kvmem_core.config import KVMemConfig

    assert resolve_plan(True, None, False) == QUICK and resolve_plan(False, None, False) == FULL
    plan, knobs = resolve_plan(True, [131072], True), KVMemConfig()
    assert plan == {**FULL, "sizes": (131072,)}
    assert (plan["budget"], plan["gen"], plan["recent"]) == (knobs.budget, knobs.gen_budget, knobs.recent_tokens)
