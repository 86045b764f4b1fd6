"""q8_0 KV on llama.cpp: the state blobs carry q8_0 rows, a workspace restored from stored blocks (host RAM, and NVMe
after a restart) answers token for token as plain llama-cpp-python with a q8_0 cache, at about half the bytes."""
from __future__ import annotations

import numpy as np
import pytest
from llamacpp_support import N_BATCH, PARAGRAPH, Plain, chat, model_path
from test_llamacpp_tiers import A1, B1, CFG, check_against_plain, second_turn

from kvmem_core.engine import KVMemEngine
from kvmem_core.errors import ConfigError

pytestmark = pytest.mark.llamacpp
Q8 = CFG.replace(kv_dtype="q8_0")
GGML_TYPE_Q8_0 = 8


@pytest.fixture(scope="module")
def adapter():
    from kvmem_llamacpp import create_adapter

    a = create_adapter(str(model_path()), Q8, n_batch=N_BATCH)
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
    assert blob.synthesize(out, 1, kv, v_trans) == len(raw) and out.tobytes() == raw
    f16 = CFG.replace(kv_dtype="f16")
    assert f16.kv_dtype == "f16" and adapter.layout.bytes_per_token / (2 * 30 * 3 * 64 * 2) == 68 / 128


def test_q8_0_workspace_restored_from_host_tier_answers_as_plain_q8_0(adapter, plain):
    engine = KVMemEngine(adapter, Q8, heads=((17, 3),))
    r1 = engine.step(chat(A1), lambda piece: True)
    engine.step(chat(B1), lambda piece: True)  # another conversation takes the view
    r2 = engine.step(chat(second_turn(r1.text)), lambda piece: True)
    assert r2.cached_tokens >= 2 * Q8.block_tokens
    check_against_plain(engine, plain, r1, r2)


def test_q8_0_workspace_restored_from_nvme_after_a_restart_answers_as_plain_q8_0(adapter, plain, tmp_path):
    cfg = Q8.replace(nvme_dir=tmp_path, cpu_gb=0.01)
    first = KVMemEngine(adapter, cfg, heads=((17, 3),))
    r1 = first.step(chat(A1), lambda piece: True)
    first.store.close()
    engine = KVMemEngine(adapter, cfg, heads=((17, 3),))
    hashes = [h for ws in engine.store.workspaces.all() for h in ws.hashes]
    assert hashes and all(engine.store.tier(h) == "nvme" for h in hashes)
    files = sorted(engine.store.nvme.blocks_dir.iterdir())
    assert files and all(b'"dtype": "q8_0"' in f.read_bytes()[:2048] for f in files)
    r2 = engine.step(chat(second_turn(r1.text)), lambda piece: True)
    assert engine.metrics()["blocks_loaded"] == r2.cached_tokens // Q8.block_tokens >= 2
    check_against_plain(engine, plain, r1, r2)
    engine.store.close()


def test_fp8_is_refused_on_llama_cpp_in_one_line():
    from kvmem_llamacpp import create_adapter

    with pytest.raises(ConfigError, match="--kv-dtype fp8 is not available on the llama.cpp engine: choose f16 or q8_0"):
        create_adapter(str(model_path()), CFG.replace(kv_dtype="fp8"))
