"""Both engines capture the same retrieval queries: the content-frame query projection without its bias.

A tiny qwen2 file (random Q/K/V biases) written once, loaded by the llama.cpp and the torch
adapter: their captured queries agree, and neither holds the bias (retrieval heads are
calibrated on one engine and used on the other, so the two must score alike).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")
pytestmark = pytest.mark.llamacpp

from kvmem_core.config import KVMemConfig  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model  # noqa: E402

CFG = KVMemConfig(ctx=256, budget=192, gen_budget=32, block_tokens=16, sink_tokens=16, recent_tokens=16)
IDS = [int(i) for i in np.random.default_rng(3).integers(3, 160, 48)]
FIRST = 40  # queries of the last 8 tokens


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, object]:
    path = tmp_path_factory.mktemp("qwen2") / "m.gguf"
    hf = tiny_hf_model("qwen2", seed=7)
    write_gguf(path, tiny_hf_config("qwen2"), hf.state_dict())
    return path, hf


def captured(backend: str, path: Path) -> np.ndarray:
    if backend == "torch":
        from kvmem_torch import create_adapter

        torch.set_num_threads(1)
        adapter = create_adapter(str(path), CFG, device="cpu")
    else:
        pytest.importorskip("llama_cpp")
        from kvmem_llamacpp import create_adapter

        adapter = create_adapter(str(path), CFG, n_threads=1)
    try:
        return adapter.forward(IDS, list(range(len(IDS))), capture_from=FIRST).queries
    finally:
        adapter.close()


def test_llama_cpp_and_torch_capture_the_same_bias_free_queries(tiny_qwen2: tuple[Path, object]) -> None:
    path, hf = tiny_qwen2
    ours, ref = captured("torch", path), captured("llama.cpp", path)
    assert ours.shape == ref.shape
    scale = np.abs(ref).max()
    np.testing.assert_allclose(ours[0], ref[0], atol=1e-4 * scale)  # layer 0: embeddings and weights alone
    np.testing.assert_allclose(ours, ref, atol=2e-2 * scale)  # later layers: llama.cpp keeps f16 KV
    layer0 = hf.model.layers[0].self_attn
    x = hf.model.layers[0].input_layernorm(hf.model.embed_tokens(torch.tensor(IDS[FIRST:])))
    without_bias = (x @ layer0.q_proj.weight.T).detach().numpy().reshape(ref.shape[1:])
    np.testing.assert_allclose(ours[0], without_bias, atol=1e-4 * scale)
    assert np.abs(layer0.q_proj.bias.detach().numpy()).max() > 100 * 1e-4 * scale  # the bias would show
