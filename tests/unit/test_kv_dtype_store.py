"""8-bit blocks through the host tier and NVMe (real files): bytes unchanged, the dtype recorded in each file, and a
file of another dtype refused by name, never read, never deleted."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvmem_core.blockfile import encode_header, read_block, read_meta, write_block
from kvmem_core.errors import BlockDtypeError
from kvmem_core.layout import BlockKV, BlockLayout, BlockMeta, chain_hash
from kvmem_core.nvme import NvmeTier
from kvmem_core.store import BlockStore
from kvmem_torch import fp8

FP8 = BlockLayout(n_layers=2, n_kv_heads=2, head_dim=32, n_heads=4, block_tokens=16, dtype="fp8_e4m3")
F16 = BlockLayout(**{**FP8.__dict__, "dtype": "float16"})


def fp8_chain(n_blocks: int) -> list[tuple[BlockMeta, BlockKV]]:
    """Blocks whose K/V are real fp8 rows (codes and scales) of random values."""
    out, parent = [], "0" * 32
    for i in range(n_blocks):
        ids = np.arange(i * 16, (i + 1) * 16, dtype=np.int32)
        k, v = (fp8.quantize(torch.randn(2, 16, 2, 32) * 4).numpy() for _ in range(2))
        kv = BlockKV(k, v)
        meta = BlockMeta(chain_hash(parent, parent, ids), parent, ids, i * 16, kv.checksum())
        out.append((meta, kv))
        parent = meta.chain_hash
    return out


def test_fp8_blocks_round_trip_host_and_nvme_with_their_dtype_recorded(tmp_path) -> None:
    assert FP8.bytes_per_token * 64 == F16.bytes_per_token * 36  # 32 codes + a 4-byte scale against 2 * 32 bytes
    store = BlockStore(FP8, cpu_bytes=FP8.kv_bytes_per_block, nvme_dir=tmp_path, nvme_bytes=1 << 20)
    blocks = fp8_chain(3)
    ws, _ = store.open_workspace("ns", np.concatenate([m.token_ids for m, _ in blocks]))
    for meta, kv in blocks:
        store.append(ws.id, meta, kv)
    store.flush()
    assert [store.tier(m.chain_hash) for m, _ in blocks].count("nvme") == 2  # one block's room in host RAM
    result = store.complete_load(store.prepare_load([m.chain_hash for m, _ in blocks]))
    for meta, kv in blocks:
        got = result.blocks[meta.chain_hash]
        assert got.k.dtype == np.uint8 and got.k.tobytes() == kv.k.tobytes() and got.v.tobytes() == kv.v.tobytes()
        path = store.nvme.path(meta.chain_hash)
        assert path.stat().st_size - FP8.kv_bytes_per_block < 1024
        assert b'"dtype": "fp8_e4m3"' in path.read_bytes()[:1024]
    store.close()


def test_a_block_file_of_another_dtype_is_refused_by_name_and_kept(tmp_path) -> None:
    meta, _ = fp8_chain(1)[0]
    k = np.zeros(F16.kv_shape, np.float16)
    wide = BlockKV(k, k)
    path = tmp_path / "wide.kvb"
    with open(path, "wb") as f:  # same shape as FP8's blocks but for the dtype: 16-bit payload
        write_block(
            f,
            encode_header(BlockMeta(meta.chain_hash, meta.parent_hash, meta.token_ids, 0, wide.checksum()), F16),
            wide,
        )
    for read in (read_meta, read_block):
        with pytest.raises(BlockDtypeError, match="its KV is float16, this store's is fp8_e4m3"):
            read(path, FP8)
    assert read_block(path, F16)[1].k.tobytes() == k.tobytes()
    tier = NvmeTier(tmp_path / "store", FP8, 1 << 20, fsync=False)
    moved = tier.path(meta.chain_hash)
    path.rename(moved)
    assert tier.scan() == ([], []) and moved.exists()  # skipped, not deleted: it is another store's block
