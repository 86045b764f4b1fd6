"""TorchAdapter through the EngineAdapter contract, on tiny GGUF models checked against HF."""

from __future__ import annotations


import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from kvmem_core.adapter import EngineAdapter, Placement  # noqa: E402
from kvmem_torch.adapter import TorchAdapter  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model  # noqa: E402

B = 16


@pytest.fixture(scope="module", params=("llama", "qwen35"))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[object, TorchAdapter]:
    torch.set_num_threads(1)
    hf = tiny_hf_model(request.param, seed=4)
    path = tmp_path_factory.mktemp("gguf") / f"{request.param}.gguf"
    write_gguf(path, tiny_hf_config(request.param), hf.state_dict())
    return hf, TorchAdapter(path, view_tokens=96, block_tokens=B, device="cpu", progress=False)


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_last(hf: object, ids: list[int]) -> np.ndarray:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0, -1].numpy()


def test_conforms_and_matches_hf(pair) -> None:
    hf, a = pair
    assert isinstance(a, EngineAdapter)
    assert a.caps.backend == "torch" and a.caps.paged_slots and a.caps.max_view_tokens == 96
    assert a.caps.recurrent_state == bool(a.model.spec.deltanet_layers)
    a.clear_view()
    ids = tokens(40)
    out = a.forward(ids, list(range(40)), capture_from=30)
    assert out.logits.dtype == np.float32 and np.abs(out.logits - hf_last(hf, ids)).max() <= 1e-4
    lay = a.layout
    assert out.queries.shape == (lay.n_layers, 10, lay.n_heads, lay.head_dim)
    assert a.view_free() == 96 - 40


def test_blocks_round_trip_bit_exact(pair) -> None:
    hf, a = pair
    a.clear_view()
    ids = tokens(41, seed=1)
    a.forward(ids[:40], list(range(40)))
    state = a.save_state()
    blocks = [a.read_block(p, min(B, 40 - p)) for p in range(0, 40, B)]
    assert blocks[0].k.shape == a.layout.kv_shape and blocks[-1].k.shape[1] == 8
    expected = a.forward(ids[40:], [40]).logits.copy()
    a.clear_view()
    a.write_blocks([Placement(kv, p, p) for kv, p in zip(blocks, range(0, 40, B))])
    a.restore_state(state)
    assert np.array_equal(a.forward(ids[40:], [40]).logits, expected)
    np.testing.assert_array_equal(a.content_keys(blocks[0].k, 0), blocks[0].k)


def test_compact_placement_and_drop(pair) -> None:
    hf, a = pair
    a.clear_view()
    ids = tokens(33, seed=2)
    a.forward(ids[:32], list(range(32)))
    state = a.save_state()
    blocks = [a.read_block(0, B), a.read_block(B, B)]
    expected = a.forward(ids[32:], [32]).logits.copy()
    a.drop(0, -1)
    assert a.view_free() == 96
    a.write_blocks([Placement(blocks[0], 0, 500), Placement(blocks[1], B, 500 + B)])
    a.restore_state(state)
    assert np.abs(a.forward(ids[32:], [532]).logits - expected).max() <= 1e-4
    a.drop(500, 500 + B)
    assert a.view_free() == 96 - B - 1


def test_a_dtype_named_by_the_flag_holds_weights_and_kv(tmp_path) -> None:
    path = tmp_path / "llama.gguf"
    hf = tiny_hf_model("llama", seed=4)
    write_gguf(path, tiny_hf_config("llama"), hf.state_dict())
    a = TorchAdapter(path, view_tokens=96, block_tokens=B, device="cpu", dtype="bfloat16", progress=False)
    try:
        ids = tokens(20)
        want = hf_last(hf, ids)
        got = a.forward(ids, list(range(20))).logits
        assert a.model.dtype == torch.bfloat16 and a.layout.dtype == "bfloat16"
        assert np.abs(got - want).max() < 0.1 * np.abs(want).max()  # bf16: close to HF's float32, not equal
    finally:
        a.close()
