"""q8_0 KV on llama.cpp: the state blobs carry q8_0 rows, a workspace restored from stored blocks (host RAM, and NVMe
after a restart) answers token for token as plain llama-cpp-python with a q8_0 cache, at about half the bytes; the
keys the scorers read and the blocks compact mode moves are the f16 cache's within quantization error."""

from __future__ import annotations

import numpy as np
import pytest
from llamacpp_support import N_BATCH, PARAGRAPH, Plain, model_path
from test_llamacpp_tiers import CFG, host_round_trip, nvme_round_trip

from kvmem_core.errors import ConfigError
from kvmem_llamacpp import q8_0
from kvmem_llamacpp.blob import GGML_TYPE_Q8_0

pytestmark = pytest.mark.llamacpp
Q8 = CFG.replace(kv_dtype="q8_0")


@pytest.fixture(scope="module")
def adapter():
    from kvmem_llamacpp import create_adapter

    a = create_adapter(str(model_path()), Q8, n_batch=N_BATCH)
    yield a
    a.close()


@pytest.fixture(scope="module")
def f16_adapter():
    from kvmem_llamacpp import create_adapter

    a = create_adapter(str(model_path()), CFG.replace(kv_dtype="f16"), n_batch=N_BATCH)
    yield a
    a.close()


@pytest.fixture(scope="module")
def plain():
    return Plain(model_path(), cache_type=GGML_TYPE_Q8_0)


def test_q8_0_blobs_parse_and_synthesize_byte_identical_at_about_half_the_bytes(adapter):
    from kvmem_llamacpp import blob

    assert adapter.layout.dtype == "q8_0" and adapter.layout.kv_shape == (30, 64, 3, 68)
    ids = adapter.tokenize(PARAGRAPH * 8)[:100]
    adapter.clear_view()
    adapter.forward(ids, list(range(100)))
    adapter.ctx.seq_cp(0, 1, 10, 74)
    raw = bytes(adapter.ctx.get_state(1))
    adapter.ctx.seq_rm(1)
    kv, v_trans = blob.parse(memoryview(raw), 30, 192)
    assert v_trans == 0 and kv.k.dtype == np.uint8 and kv.k.shape == (30, 64, 3 * 68)
    out = np.zeros(len(raw), dtype=np.uint8)
    assert blob.synthesize(out, 1, [kv], v_trans) == len(raw) and out.tobytes() == raw
    f16 = CFG.replace(kv_dtype="f16")
    assert f16.kv_dtype == "f16" and adapter.layout.bytes_per_token / (2 * 30 * 3 * 64 * 2) == 68 / 128


def test_q8_0_workspace_restored_from_host_tier_answers_as_plain_q8_0(adapter, plain):
    host_round_trip(adapter, plain, Q8)


def test_q8_0_workspace_restored_from_nvme_after_a_restart_answers_as_plain_q8_0(adapter, plain, tmp_path):
    nvme_round_trip(adapter, plain, Q8.replace(nvme_dir=tmp_path))
    files = list(tmp_path.rglob("*.kvb"))
    assert files and all(b'"dtype": "q8_0"' in f.read_bytes()[:2048] for f in files)


def second_block(adapter, ids: list[int]):
    adapter.clear_view()
    adapter.forward(ids, list(range(len(ids))), want_logits=False)
    return adapter.read_block(64, 64)


def assert_near_per_layer(got: np.ndarray, want: np.ndarray) -> None:
    """Each layer's values within 25% relative error of ``want``'s: quantization noise, which grows through the
    layers (each attends over a quantized cache), stays under 15% on this model; keys in another frame (llama.cpp's
    Hadamard-rotated K and V of a quantized cache) are off by more than 100%."""
    for layer, (g, w) in enumerate(zip(got.astype(np.float32), want.astype(np.float32))):
        assert np.linalg.norm(g - w) / np.linalg.norm(w) < 0.25, layer


def test_q8_0_keys_scored_and_moved_read_as_the_f16_caches(adapter, f16_adapter):
    """Past the view, a q8_0 block's content keys (what retrieval scores), its K moved to another position (compact
    mode) and its V agree with the same block of an f16 cache."""
    ids = adapter.tokenize(PARAGRAPH * 8)[:192]
    q8, f16 = second_block(adapter, ids), second_block(f16_adapter, ids)
    assert_near_per_layer(adapter.content_keys(q8.k, 64), f16_adapter.content_keys(f16.k, 64))
    assert_near_per_layer(q8_0.dequantize(adapter.moved(q8, 64, 5).k), f16_adapter.moved(f16, 64, 5).k)
    assert_near_per_layer(q8_0.dequantize(q8.v), f16.v)


def test_fp8_is_refused_on_llama_cpp_in_one_line():
    from kvmem_llamacpp import create_adapter

    with pytest.raises(
        ConfigError, match="--kv-dtype fp8 is not available on the llama.cpp engine: choose f16 or q8_0"
    ):
        create_adapter(str(model_path()), CFG.replace(kv_dtype="fp8"))
