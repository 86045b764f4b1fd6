"""The torch speed benchmark on a tiny random qwen35 model on the CPU: every figure present and consistent."""
from __future__ import annotations

import pytest
import torch

from kvmem.bench.speed_common import floor_s
from kvmem.bench.speed_torch import run

PLAN = dict(view=512, workspaces=(512, 2048), histories=(1024,), turn=256, replay=128, decode=2, hf=False)


@pytest.fixture(scope="module")
def result():
    torch.set_num_threads(1)
    return run(quick=True, shape="tiny", plan=PLAN, log=lambda line: None)


def test_contract_keys_and_headline_ratios(result):
    assert result["backend"] == "torch" and result["model"] == "random-qwen35-tiny"
    ttft, pts = result["ttft"][-1], result["points"]
    assert result["ttft_speedup"] == pytest.approx(ttft["reprefill_ttft_s"] / ttft["reuse_ttft_s"])
    assert result["decode_flatness"] == pytest.approx(pts[-1]["kvmem_tok_s"] / pts[0]["kvmem_tok_s"])
    assert 0 < result["nvme_vs_raw"] and 0 < result["host_vs_raw"]


def test_reuse_phases_add_up_and_turn_shape_is_recorded(result):
    ttft, = result["ttft"]
    assert set(ttft["phases_s"]) == {"prefill", "archive", "select", "materialize", "replay"}
    assert sum(ttft["phases_s"].values()) == pytest.approx(ttft["reuse_ttft_s"])
    assert all(seconds > 0 for seconds in ttft["phases_s"].values())  # every phase was timed, none skipped
    assert (ttft["history_tokens"], ttft["turn_tokens"], ttft["replayed_tokens"]) == (1024, 256, 128)


def test_decode_points_hold_the_fixed_view_and_their_floor(result):
    kv, weights, hbm = result["kv_bytes_per_token"], result["weights_GB"] * 1e9, result["bandwidths"]["hbm_copy_GBps"]
    assert kv == 1 * 2 * 2 * 256 * 4  # per token: 1 attention layer (of 4), K and V, 2 kv heads x 256, fp32
    for p in result["points"]:
        assert p["view_tokens"] == PLAN["view"] and p["materialized_blocks"] == PLAN["view"] // 128
        floor = floor_s(weights + p["view_tokens"] * kv, hbm)
        assert p["floor_tok_s"] == pytest.approx(1 / floor)
        assert p["fraction_of_floor"] == pytest.approx(p["kvmem_tok_s"] * floor)


def test_dense_comparison_uses_the_bytes_ratio(result):
    kv, w = result["kv_bytes_per_token"], result["weights_GB"] * 1e9
    assert [d["workspace_tokens"] for d in result["dense"]] == [512, 2048]
    for d, p in zip(result["dense"], result["points"]):
        assert d["theoretical_ratio"] == pytest.approx((w + d["workspace_tokens"] * kv) / (w + 512 * kv))
        assert d["kvmem_speedup"] == pytest.approx(p["kvmem_tok_s"] / d["dense_tok_s"])
        assert p["full_tok_s"] == d["dense_tok_s"] and d["dense_tok_s"] > 0
