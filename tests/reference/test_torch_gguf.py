"""GGUF path: tiny HF models written the way llama.cpp's converter writes them load back exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvmem_core.gguf_file import GGUFFile  # noqa: E402
from kvmem_torch.gguf_loader import convert_tensor, load_gguf  # noqa: E402
from gguf_writer import is_quantized, roundtrip, to_gguf_tensor, write_gguf  # noqa: E402
from kvmem_torch.hf_loader import internal_name  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.paged import View  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model  # noqa: E402

ARCHS = ("llama", "qwen2", "qwen35")


def run_ours(model: Model, ids: torch.Tensor) -> torch.Tensor:
    cache = model.new_cache(12, 16)
    return model.run(ids, torch.arange(len(ids)), cache, View(), model.new_state(), last_only=False)


def hf_logits(hf: object, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids[None]).logits[0]


@pytest.fixture(scope="module")
def ids() -> torch.Tensor:
    torch.set_num_threads(1)
    return torch.randint(0, 160, (90,), generator=torch.Generator().manual_seed(11))


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_gguf_matches_hf(arch: str, ids: torch.Tensor, tmp_path: Path) -> None:
    hf = tiny_hf_model(arch, seed=5)
    write_gguf(tmp_path / "m.gguf", tiny_hf_config(arch), hf.state_dict())
    spec, weights, meta = load_gguf(tmp_path / "m.gguf", torch.float32, progress=False)
    assert spec.n_layers == hf.config.num_hidden_layers and spec.vocab_size == 160
    assert meta["general.architecture"] == arch
    assert (run_ours(Model(spec, weights), ids) - hf_logits(hf, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch", ARCHS)
def test_q8_0_gguf_matches_hf_rebuilt_from_dequantized(arch: str, ids: torch.Tensor, tmp_path: Path) -> None:
    hf = tiny_hf_model(arch, seed=6)
    state = hf.state_dict()
    write_gguf(tmp_path / "m.gguf", tiny_hf_config(arch), state, qtype="Q8_0")
    spec, weights, _ = load_gguf(tmp_path / "m.gguf", torch.float32, progress=False)
    f = GGUFFile(tmp_path / "m.gguf")
    assert sum(info.qtype == 8 for info in f.tensors.values()) >= 3 * spec.n_layers  # 8: Q8_0
    f.close()
    with torch.no_grad():  # round each matrix in its GGUF layout (blocks of 32 along GGUF rows), then map back
        for name, t in state.items():
            g = to_gguf_tensor(spec, name, t)
            if is_quantized(g):
                t.copy_(convert_tensor(spec, internal_name(name), roundtrip(g, "Q8_0")).reshape(t.shape))
    ours, ref = run_ours(Model(spec, weights), ids), hf_logits(hf, ids)
    assert (ours - ref).abs().max().item() <= 1e-4


def test_mtp_block_loads_as_the_mtp_layer(tmp_path: Path) -> None:
    """block_count includes nextn_predict_layers; that block is not loaded as a decoder layer but as the MTP
    layer (its nextn tensors and its decoder tensors under ``mtp.``)."""
    import gguf

    path = tmp_path / "mtp.gguf"
    w = gguf.GGUFWriter(str(path), "qwen35")
    cfg = tiny_hf_config("qwen35")
    for key, value in {"block_count": cfg["num_hidden_layers"] + 1, "nextn_predict_layers": 1}.items():
        w.add_uint32(f"qwen35.{key}", value)
    w.add_tensor("blk.4.nextn.eh_proj.weight", torch.zeros(4, 4).numpy())
    w.add_tensor("blk.4.attn_q.weight", torch.zeros(4, 4).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    from kvmem_torch.gguf_loader import internal_name as gguf_internal_name

    f = GGUFFile(path)
    n_layers = f.meta["qwen35.block_count"] - f.meta["qwen35.nextn_predict_layers"]
    assert [gguf_internal_name(n, n_layers) for n in f.tensors] == ["mtp.fc", "mtp.layers.0.q"]
    assert gguf_internal_name("blk.3.attn_q.weight", n_layers) == "layers.3.q"
    f.close()


@pytest.mark.llamacpp
@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_agrees_on_the_same_f32_gguf(arch: str, ids: torch.Tensor, tmp_path: Path) -> None:
    """Three-way oracle: the file our writer produced is read by llama.cpp (f32 KV) the same way we read it."""
    llama_cpp = pytest.importorskip("llama_cpp")
    hf = tiny_hf_model(arch, seed=5)
    write_gguf(tmp_path / "m.gguf", tiny_hf_config(arch), hf.state_dict())
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
    expected = torch.tensor(ref.scores[: len(ids)])
    spec, weights, _ = load_gguf(tmp_path / "m.gguf", torch.float32, progress=False)
    assert (run_ours(Model(spec, weights), ids) - expected).abs().max().item() <= 1e-4
