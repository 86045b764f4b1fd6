"""Real weights: Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2: QKV biases; Q4_K, Q5_0, Q6_K and Q8_0 tensors)
through the torch engine on the CPU, against plain llama-cpp-python on the same file."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvmem_core.errors import ModelNotFoundError
from kvmem_core.gguf_file import GGUFFile
from kvmem_torch.gguf_loader import internal_name, load_gguf
from kvmem_torch.model import Model
from kvmem_torch.paged import View
from kvmem_torch.spec import spec_from_gguf
from kvmem_torch.tokenizer import Tokenizer, from_gguf_meta

PROMPTS = (
    "What is the capital of France?",
    "What is 2 + 2?",
    "Write a Python function that returns the square of a number.",
)
N_TOKENS = 16
QTYPES = {"Q8_0": 8, "Q5_0": 6, "Q4_K": 12, "Q6_K": 14}


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    from kvmem.models import resolve_model

    try:
        return resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def ours(gguf_path: Path) -> tuple[Model, Tokenizer]:
    torch.set_num_threads(1)
    spec, weights, meta = load_gguf(gguf_path, torch.float32, progress=False)
    return Model(spec, weights), from_gguf_meta(meta)


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> object:
    llama_cpp = pytest.importorskip("llama_cpp")
    return llama_cpp.Llama(str(gguf_path), n_ctx=512, n_batch=512, n_threads=1, verbose=False)


def greedy_ours(model: Model, ids: list[int]) -> list[int]:
    cache, view, state = model.new_cache(4, 128), View(), model.new_state()
    logits, out = model.run(torch.tensor(ids), torch.arange(len(ids)), cache, view, state), []
    while len(out) < N_TOKENS:
        out.append(int(logits[-1].argmax()))
        logits = model.run(torch.tensor(out[-1:]), torch.tensor([view.length]), cache, view, state)
    return out


def greedy_llama_cpp(ref: object, ids: list[int]) -> list[int]:
    import llama_cpp
    import numpy as np

    ref.reset()
    ref.eval(ids)
    out = []
    while len(out) < N_TOKENS:
        last = np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(ref.ctx, -1), shape=(ref.n_vocab(),))
        out.append(int(last.argmax()))
        ref.eval(out[-1:])
    return out


def test_the_file_is_qwen2_with_biases_and_every_quant_type(gguf_path: Path) -> None:
    f = GGUFFile(gguf_path)
    spec = spec_from_gguf(f.meta, len(f.meta["tokenizer.ggml.tokens"]), "output.weight" in f.tensors)
    qtypes = {info.qtype for info in f.tensors.values()}
    names = {internal_name(n, spec.n_layers) for n in f.tensors}
    f.close()
    assert spec.arch == "qwen2" and spec.rope_theta == 1e6 and spec.n_layers == 24
    assert set(QTYPES.values()) <= qtypes
    assert {f"layers.{i}.{b}_bias" for i in range(24) for b in "qkv"} <= names


@pytest.mark.slow  # ~20 s to dequantize the file, ~15 s per prompt on one thread
@pytest.mark.llamacpp
@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_tokens_equal_llama_cpp(prompt: str, ours: tuple[Model, Tokenizer], reference: object) -> None:
    model, tok = ours
    text = tok.render_chat([{"role": "user", "content": prompt}])
    ids = tok.encode(text)
    assert ids == reference.tokenize(text.encode(), add_bos=False, special=True)
    got = greedy_ours(model, ids)
    assert got == greedy_llama_cpp(reference, ids), tok.decode(got)
    if "France" in prompt:
        assert "Paris" in tok.decode(got)
