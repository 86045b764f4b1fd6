"""The layout hash names a block's namespace and its NVMe folder: it stays the same across versions for rows that
did not change (stored workspaces survive an upgrade), and moves where a dtype's rows changed meaning."""

from kvmem_core.layout import BlockLayout

BEFORE = {  # the hashes of 2026-12-06, before q8_0 rows were made without llama.cpp's attention rotation
    "float16": "d7cce5ec712e11b9",
    "bfloat16": "fbedfd731999613a",
    "fp8_e4m3": "56f6d3faf8662d9e",
    "float32": "0ae3d1355294b2be",
    "q8_0": "cdab838964df4b83",
}


def layout(dtype: str) -> BlockLayout:
    return BlockLayout(24, 2, 64, 14, 64, dtype)


def test_unchanged_rows_keep_their_hash() -> None:
    for dtype in ("float16", "bfloat16", "fp8_e4m3", "float32"):
        assert layout(dtype).layout_hash() == BEFORE[dtype], dtype


def test_q8_0_rows_of_a_rotated_cache_hash_apart() -> None:
    assert layout("q8_0").layout_hash() != BEFORE["q8_0"]
    assert len({layout(dtype).layout_hash() for dtype in BEFORE}) == len(BEFORE)
