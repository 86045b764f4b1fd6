"""``kvmem bench speed``: decode speed against the plain engine, turn-2 time to first token with reuse
against a cold re-prefill, and block export/import bandwidth. Everything fits the budget here, so
KVMem's path is the identity path; the numbers are its overhead."""
from __future__ import annotations

import platform
import time
from typing import Any

import numpy as np

from kvmem_core.adapter import Placement
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine

FILLER = "The survey team logged soil samples, wind speed and the colour of the evening sky at each camp. "


def run_speed(backend: str, model_path: str, *, decode_tokens: int = 64, prompt_repeats: int = 16) -> dict[str, Any]:
    """All speed numbers for one backend on one model, as a JSON-ready dict."""
    from kvmem.engines import adapter_factory

    config = KVMemConfig(ctx=8192, budget=4096, gen_budget=512, positions="original")
    adapter = adapter_factory(backend)(model_path, config)
    engine = KVMemEngine(adapter, config, heads=((1, 0),))
    try:
        out = {"backend": backend, "model": adapter.model_id, "machine": f"{platform.machine()} {platform.processor()}".strip()}
        out["decode"] = _decode(engine, model_path, decode_tokens, backend)
        out["turn2_ttft"] = _ttft(engine, adapter, config, prompt_repeats)
        out["blocks"] = _transfer(adapter)
    finally:
        engine.close()
    return out


def _greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens)


def _decode(engine: KVMemEngine, model_path: str, n: int, backend: str, rounds: int = 5) -> dict[str, float]:
    """Best of ``rounds`` interleaved runs per side (the machine is shared; the best run is the least disturbed)."""
    messages = ({"role": "user", "content": FILLER * 8 + "Describe the camps in detail."},)
    request = StepRequest(messages=messages, sampling=_greedy(n))
    ids = engine.tokenize(engine.adapter.render_chat(messages))
    plain = _PlainDecoder(model_path, ids) if backend == "llama.cpp" else None
    ours, theirs = [], []
    for _ in range(rounds):
        result = engine.step(request, lambda piece: True)
        ours.append(result.timings["decode_tokens"] / result.timings["decode_s"])
        if plain is not None:
            theirs.append(plain.decode(n))
    best_plain = max(theirs) if theirs else float("nan")
    return {"kvmem_tok_s": round(max(ours), 2), "plain_tok_s": round(best_plain, 2),
            "ratio": round(max(ours) / best_plain, 3), "tokens": len(result.token_ids), "rounds": rounds}


class _PlainDecoder:
    """Plain llama-cpp-python greedy decoding after a prompt, repeatable."""

    def __init__(self, model_path: str, ids: list[int]) -> None:
        import llama_cpp

        self.L, self.ids = llama_cpp, ids
        self.llm = llama_cpp.Llama(model_path, n_ctx=4608, n_batch=512, n_threads=1, flash_attn=True, verbose=False)
        self.llm.eval(ids)

    def decode(self, n: int) -> float:
        L, llm = self.L, self.llm
        llm.n_tokens = len(self.ids) - 1
        llm.eval(self.ids[-1:])
        t0, done = time.perf_counter(), 0
        for _ in range(n):
            logits = np.ctypeslib.as_array(L.llama_get_logits_ith(llm._ctx.ctx, -1), shape=(llm.n_vocab(),))
            token = int(np.argmax(logits))
            if L.llama_vocab_is_eog(llm._model.vocab, token):
                break
            llm.eval([token])
            done += 1
        return done / (time.perf_counter() - t0)


def _ttft(engine: KVMemEngine, adapter: Any, config: KVMemConfig, repeats: int) -> dict[str, float]:
    turn1 = ({"role": "user", "content": FILLER * repeats + "Which camp was windiest?"},)
    r1 = engine.step(StepRequest(messages=turn1, sampling=_greedy(16)), lambda piece: True)
    turn2 = turn1 + ({"role": "assistant", "content": r1.text}, {"role": "user", "content": "And the calmest?"})
    reuse = engine.step(StepRequest(messages=turn2, sampling=_greedy(1)), lambda piece: True)
    cold_engine = KVMemEngine(adapter, config, heads=((1, 0),))
    cold = cold_engine.step(StepRequest(messages=turn2, sampling=_greedy(1)), lambda piece: True)
    cold_engine.store.close()
    t_reuse = reuse.timings["prefill_s"] + reuse.timings["select_s"]
    t_cold = cold.timings["prefill_s"] + cold.timings["select_s"]
    return {"prompt_tokens": reuse.prompt_tokens, "cached_tokens": reuse.cached_tokens, "reuse_s": round(t_reuse, 4),
            "cold_s": round(t_cold, 4), "speedup": round(t_cold / t_reuse, 2)}


def _transfer(adapter: Any, n_blocks: int = 16, rounds: int = 5) -> dict[str, float]:
    bt = adapter.layout.block_tokens
    ids = adapter.tokenize(FILLER * 200)[: n_blocks * bt]
    adapter.clear_view()
    for s in range(0, len(ids), 512):
        adapter.forward(ids[s:s + 512], list(range(s, min(s + 512, len(ids)))), want_logits=False)
    t_out = t_in = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        blocks = [adapter.read_block(b * bt, bt) for b in range(n_blocks)]
        t1 = time.perf_counter()
        adapter.clear_view()
        t2 = time.perf_counter()
        adapter.write_blocks([Placement(kv, b * bt, b * bt) for b, kv in enumerate(blocks)])
        t_out, t_in = t_out + t1 - t0, t_in + time.perf_counter() - t2
    mb = rounds * sum(kv.nbytes for kv in blocks) / 1e6
    adapter.clear_view()
    return {"block_mb": round(blocks[0].nbytes / 1e6, 3), "export_mb_s": round(mb / t_out, 1),
            "import_mb_s": round(mb / t_in, 1), "export_ms_per_block": round(1e3 * t_out / (rounds * n_blocks), 3),
            "import_ms_per_block": round(1e3 * t_in / (rounds * n_blocks), 3)}
