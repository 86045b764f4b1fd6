"""The real default model: the assembled file has the pinned size and sha256, and llama.cpp answers with it."""

from __future__ import annotations

import hashlib

import pytest

from kvmem import models
from kvmem.models import QWEN_CODER_05B
from kvmem_core.errors import ModelNotFoundError


@pytest.mark.llamacpp
def test_the_real_default_has_the_pinned_hash_and_answers() -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    try:
        path = QWEN_CODER_05B.path()
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(models.CHUNK_BYTES):
            digest.update(chunk)
    assert path.stat().st_size == QWEN_CODER_05B.size and digest.hexdigest() == QWEN_CODER_05B.sha256
    llm = llama_cpp.Llama(str(path), n_ctx=256, n_threads=1, verbose=False)
    try:
        reply = llm.create_chat_completion(
            [{"role": "user", "content": "What is the capital of France?"}], max_tokens=12, temperature=0.0
        )
    finally:
        llm.close()
    assert "Paris" in reply["choices"][0]["message"]["content"]
