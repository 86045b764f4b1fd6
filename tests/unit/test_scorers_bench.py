"""The core benchmark's scoring part on small shapes: every scorer runs and finds the needle."""

from __future__ import annotations

import dataclasses

from kvmem_bench import core as bench


def test_bench_workspace_small_shapes():
    for shape in (bench.QWEN_27B_1M, bench.SMOLLM2_64K):
        small = dataclasses.replace(shape, n_blocks=12, budget=1024, per_token=True)
        got = bench.bench_workspace(small, repeats=1, log=False)
        assert list(got) == list(bench.SCORERS)
        assert all(isinstance(ms, float) and ms > 0 for ms in got.values())


def test_per_token_is_null_where_it_does_not_fit():
    small = dataclasses.replace(bench.QWEN_27B_1M, n_blocks=8, budget=1024)
    assert bench.bench_workspace(small, repeats=1, log=False)["per-token"] is None
