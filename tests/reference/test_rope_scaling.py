"""RoPE scaling (linear, llama3): the torch engine against HF transformers, through HF weights and
through a GGUF carrying ``rope_freqs`` as llama.cpp's converter writes it; llama.cpp reads that GGUF
alike, and the llama.cpp adapter's own rotations (block moves, content keys) follow its factors."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvmem_core.adapter import Placement  # noqa: E402
from kvmem_core.errors import UnsupportedModelError  # noqa: E402
from kvmem_torch.gguf_loader import load_gguf  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.paged import View  # noqa: E402
from kvmem_core.gguf_file import gguf_rope_factors  # noqa: E402
from kvmem_torch.spec import spec_from_hf  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model, tiny_spec_weights  # noqa: E402

# original context 64 puts the tiny model's 8 frequencies in all three llama3 bands (kept, ramp, divided)
SCALINGS = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


def scaled_config(kind: str) -> dict:
    return tiny_hf_config("llama") | {"rope_parameters": {"rope_theta": 10000.0, **SCALINGS[kind]}}


def logits(model: Model, ids: torch.Tensor) -> torch.Tensor:
    return model.run(ids, torch.arange(len(ids)), model.new_cache(12, 16), View(), model.new_state(), last_only=False)


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    torch.set_num_threads(1)
    return torch.randint(0, 160, (150,), generator=torch.Generator().manual_seed(12))


@pytest.mark.parametrize("kind", sorted(SCALINGS))
def test_scaled_rope_matches_hf_from_weights_and_from_gguf(kind: str, ids: torch.Tensor, tmp_path: Path) -> None:
    config = scaled_config(kind)
    hf = tiny_hf_model("llama", seed=7, config=config)
    with torch.no_grad():
        truth = hf(ids[None]).logits[0]
    spec, weights = tiny_spec_weights(hf)
    assert len(set(spec.rope_factors)) == (1 if kind == "linear" else 4)  # 1, ramp values, factor
    assert (logits(Model(spec, weights), ids) - truth).abs().max().item() <= 1e-4
    write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    g_spec, g_weights, _ = load_gguf(tmp_path / "m.gguf", torch.float32, progress=False)
    assert g_spec.rope_factors == pytest.approx(spec.rope_factors, rel=1e-6)
    assert (logits(Model(g_spec, g_weights), ids) - truth).abs().max().item() <= 1e-4
    unscaled = Model(spec_from_hf(tiny_hf_config("llama")), tiny_spec_weights(hf)[1])
    assert (logits(unscaled, ids) - truth).abs().max().item() > 1e-2  # the scaling matters at these positions


@pytest.mark.llamacpp
def test_llama_cpp_applies_the_same_rope_freqs(ids: torch.Tensor, tmp_path: Path) -> None:
    llama_cpp = pytest.importorskip("llama_cpp")
    config = scaled_config("llama3")
    hf = tiny_hf_model("llama", seed=7, config=config)
    write_gguf(tmp_path / "m.gguf", config, hf.state_dict())
    ref = llama_cpp.Llama(
        str(tmp_path / "m.gguf"),
        n_ctx=256,
        n_batch=256,
        n_threads=1,
        type_k=0,
        type_v=0,
        logits_all=True,
        verbose=False,
    )
    ref.eval(ids.tolist())
    spec, weights, _ = load_gguf(tmp_path / "m.gguf", torch.float32, progress=False)
    ours = logits(Model(spec, weights), ids)
    assert (ours - torch.tensor(ref.scores[: len(ids)])).abs().max().item() <= 1e-4


@pytest.mark.llamacpp
def test_llama_cpp_adapter_rotates_blocks_with_the_files_rope_freqs(tmp_path: Path) -> None:
    pytest.importorskip("llama_cpp")
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    config = scaled_config("llama3")
    write_gguf(tmp_path / "m.gguf", config, tiny_hf_model("llama", seed=7, config=config).state_dict())
    adapter = LlamaCppAdapter(tmp_path / "m.gguf", view_tokens=256, block_tokens=16)
    try:
        blocks = {}
        for start in (0, 1000):
            adapter.clear_view()
            adapter.forward(list(range(3, 19)), list(range(start, start + 16)))
            blocks[start] = adapter.read_block(start, 16)
        adapter.clear_view()
        adapter.write_blocks([Placement(blocks[0], 0, 1000)])
        moved = adapter.read_block(1000, 16).k.astype(np.float32)
        assert np.abs(moved - blocks[1000].k.astype(np.float32)).max() < 0.01  # f16 rounding only
        content = adapter.content_keys(blocks[1000].k, 1000) - adapter.content_keys(blocks[0].k, 0)
        assert np.abs(content).max() < 0.01
        assert len(set(adapter.model.rope_factors.tolist())) == 4
    finally:
        adapter.close()


def test_unsupported_scalings_are_refused_by_name() -> None:
    yarn = tiny_hf_config("llama") | {"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        spec_from_hf(yarn)
    with pytest.raises(UnsupportedModelError, match="'yarn'"):
        gguf_rope_factors({"llama.rope.scaling.type": "yarn"}, "llama", 16, None)
    assert gguf_rope_factors(
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}, "llama", 4, [1.0, 3.0]
    ) == (2.0, 6.0)
