"""KVMem's overhead where everything fits: decode tok/s of the engine against plain llama-cpp-python.

With the whole prompt inside the budget the step selects and replays nothing, so this is
the cost of KVMem's own per-token work (view bookkeeping, the query-capture callback, its
sampler); the blocks an answer completes are archived after its last token (``archive_s``). Both
sides compute with the same threads and GPU layers (``plain_opts``). The machine may be
shared: rounds interleave the two sides and the best of each is kept.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from kvmem_bench.speed_common import decode_rate
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest

FILLER = "The survey team logged soil samples, wind speed and the colour of the evening sky at each camp. "
CONFIG = KVMemConfig(ctx=8192, budget=4096, gen_budget=512, positions="original")


def decode_overhead(
    model_path: str, *, decode_tokens: int = 64, rounds: int = 5, compute: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Best-of-``rounds`` decode tok/s of KVMem and of plain llama-cpp-python on one prompt, and their ratio.
    ``compute``: the adapter's thread and GPU-layer options (``kvmem.compute``)."""
    from kvmem.engines import load_engine

    engine = load_engine("llama.cpp", model_path, CONFIG, **(compute or {}))
    messages = ({"role": "user", "content": FILLER * 8 + "Describe the camps in detail."},)
    request = StepRequest(messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=decode_tokens))
    plain = PlainDecoder(model_path, engine.tokenize(engine.adapter.render_chat(messages)), plain_opts(engine.adapter))
    ours, theirs = [], []
    try:
        for _ in range(rounds):
            result = engine.step(request, lambda piece: True)
            ours.append(decode_rate(result))
            theirs.append(plain.decode(decode_tokens))
    finally:
        engine.close()
        plain.close()
    return {
        "kvmem_tok_s": round(max(ours), 2),
        "plain_tok_s": round(max(theirs), 2),
        "decode_vs_plain": round(max(ours) / max(theirs), 3),
        "tokens": len(result.token_ids),
        "rounds": rounds,
        "compute": plain.opts,
    }


def plain_opts(adapter: Any) -> dict[str, Any]:
    """``llama_cpp.Llama`` options that compute like ``adapter`` (a ``LlamaCppAdapter``): threads, GPU layers and
    whether CPU batches may borrow the GPU."""
    threads, layers = adapter.ctx.threads, adapter.model.n_gpu_layers
    return {
        "n_threads": threads.decode,
        "n_threads_batch": threads.batch,
        "n_gpu_layers": layers,
        "op_offload": layers != 0,
    }


class PlainDecoder:
    """Plain llama-cpp-python greedy decoding after a fixed prompt, repeatable."""

    def __init__(self, model_path: str, ids: list[int], opts: dict[str, Any]) -> None:
        import llama_cpp

        self.L, self.ids, self.opts = llama_cpp, ids, opts
        self.llm = llama_cpp.Llama(model_path, n_ctx=4608, n_batch=512, flash_attn=True, verbose=False, **opts)
        self.llm.eval(ids)

    def decode(self, n: int) -> float:
        """Tokens per second of greedy decoding up to ``n`` tokens after the prompt."""
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

    def close(self) -> None:
        self.llm.close()
