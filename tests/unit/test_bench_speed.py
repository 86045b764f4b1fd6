"""The speed benchmark's math and output contract: ratios, floors, goals, table, files, phase clock."""

from __future__ import annotations

import json
import math
import time
from types import SimpleNamespace

import numpy as np
import pytest

from kvmem_bench.speed_common import (
    decode_rate,
    floor_s,
    goals,
    headline,
    merge_runs,
    ratio,
    rss_mb,
    table,
    write_outputs,
)
from kvmem_bench.speed_session import ForwardClock, baseline_ratios
from kvmem_core.adapter import ForwardOut

CONTRACT = {"backend", "model", "ttft_speedup", "decode_flatness", "nvme_vs_raw", "host_vs_raw"}


def points() -> list[dict]:
    return [
        {
            "workspace_tokens": 1024,
            "reuse_ttft_s": 2.0,
            "reprefill_ttft_s": 8.0,
            "kvmem_tok_s": 50.0,
            "full_tok_s": 50.0,
        },
        {
            "workspace_tokens": 8192,
            "reuse_ttft_s": 2.5,
            "reprefill_ttft_s": 100.0,
            "kvmem_tok_s": 47.5,
            "full_tok_s": None,
        },
    ]


def test_ratio_is_none_for_missing_or_degenerate_inputs():
    assert ratio(9.0, 3.0) == 3.0
    assert ratio(None, 3.0) is None and ratio(3.0, None) is None
    assert ratio(1.0, 0.0) is None and ratio(1.0, -2.0) is None
    assert ratio(math.nan, 1.0) is None and ratio(1.0, math.inf) is None


def test_floor_is_bytes_over_bandwidth():
    assert floor_s(2e9, 4.0) == pytest.approx(0.5)
    assert floor_s(51.25e9 + 32768 * 65536, 4266.8) == pytest.approx((51.25e9 + 2147483648) / 4266.8e9)


def test_headline_takes_ttft_at_the_largest_and_flatness_largest_over_smallest():
    out = headline("llama.cpp", "m", points(), {"nvme_vs_raw": 0.9, "host_vs_raw": 0.5})
    assert CONTRACT <= set(out)
    assert out["ttft_speedup"] == pytest.approx(40.0)
    assert out["decode_flatness"] == pytest.approx(0.95)
    assert out["workspace_growth"] == pytest.approx(8.0)
    assert (out["nvme_vs_raw"], out["host_vs_raw"], out["largest_workspace_tokens"]) == (0.9, 0.5, 8192)


def test_goals_use_the_quick_threshold_only_for_quick_runs():
    result = {"ttft_speedup": 12.0, "decode_flatness": 0.89, "nvme_vs_raw": 0.8}
    assert goals(result, quick=True) == {
        "ttft_speedup>=10": True,
        "decode_flat_within_10pct": False,
        "nvme_vs_raw>=0.8": True,
    }
    assert goals(result, quick=False)["ttft_speedup>=30"] is False
    assert goals({"ttft_speedup": None, "decode_flatness": 1.05, "nvme_vs_raw": None}, quick=False) == {
        "ttft_speedup>=30": None,
        "decode_flat_within_10pct": True,
        "nvme_vs_raw>=0.8": None,
    }


def test_table_shows_measured_columns_and_dashes_for_gaps():
    pts = points()
    pts[0]["ttft_speedup"], pts[1]["ttft_speedup"] = 4.0, 40.0
    lines = table(pts).splitlines()
    assert len(lines) == 3 and "full tok/s" in lines[0] and "rss MB" not in lines[0]
    assert lines[2].split() == ["8192", "2.500", "100.00", "40.0x", "47.5", "-"]


def test_outputs_are_json_and_png_files(tmp_path):
    result = {"backend": "torch", "points": points()}
    paths = write_outputs(result, tmp_path / "out")
    assert [p.name for p in paths] == ["speed.json", "ttft.png", "decode.png"]
    assert json.loads(paths[0].read_text()) == result
    assert all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in paths[1:])


def test_runs_of_one_size_each_plot_together_and_a_foreign_file_is_named(tmp_path):
    small, large = points()
    for name, point in (("b", large), ("a", small)):
        write_outputs({"backend": "torch", "points": [point]}, tmp_path / name)
    paths = [tmp_path / "b" / "speed.json", tmp_path / "a" / "speed.json"]
    merged = merge_runs(paths)
    assert merged["backend"] == "torch" and merged["points"] == [small, large]
    assert merged["sources"] == [str(p) for p in paths]
    (tmp_path / "c.json").write_text(json.dumps({"backend": "llama.cpp", "points": [small]}))
    with pytest.raises(ValueError, match="different backends"):
        merge_runs([*paths, tmp_path / "c.json"])
    (tmp_path / "d.json").write_text("[]")
    with pytest.raises(ValueError, match=r"d\.json: not a kvmem bench speed result"):
        merge_runs([tmp_path / "d.json"])


def test_rss_reads_this_process():
    current, peak = rss_mb()
    assert 0 < current <= peak


class _Adapter:
    """Forwards that return before their logits are out, as on a GPU: reading them takes ``WAIT`` seconds."""

    WAIT = 0.02

    def forward(self, tokens, positions, **kwargs):
        return ForwardOut(read=lambda: time.sleep(self.WAIT) or np.zeros(len(tokens), dtype=np.float32))


def test_forward_clock_separates_prefill_replay_and_decode_and_waits_for_multi_token_logits():
    adapter = _Adapter()
    clock = ForwardClock(adapter)
    outs = [adapter.forward([0] * n, []) for n in (512, 488, 256, 1, 1)]
    durations = [sec for _, sec in clock.calls]
    assert [n for n, _ in clock.calls] == [512, 488, 256, 1, 1]
    assert min(durations[:3]) >= _Adapter.WAIT > max(durations[3:])
    assert clock.replay_s(1000) == durations[2]
    assert clock.first_pass_s(1000) == pytest.approx(sum(durations[:2]))
    assert outs[0].logits.shape == (512,) and outs[-1].logits.shape == (1,)
    clock.reset()
    assert clock.calls == [] and clock.replay_s(0) == 0.0


def test_forward_clock_keeps_probes_apart_so_a_probed_window_is_no_replay():
    adapter = _Adapter()
    clock = ForwardClock(adapter)
    adapter.forward([0] * 129, [])
    adapter.forward([0] * 256, [], capture_from=128, stop_after=7)  # the probe: the scorer's layers only
    adapter.forward([0] * 256, [])  # the window in full, once, after selection
    adapter.forward([0], [])
    full = [sec for _, sec in clock.calls]
    assert [n for n, _ in clock.calls] == [129, 256, 1] and [n for n, _ in clock.probes] == [256]
    assert clock.replay_s(385) == 0.0 and clock.first_pass_s(385) == pytest.approx(full[0] + full[1])
    assert clock.probe_s() == clock.probes[0][1] and clock.probed_tokens() == 256


def test_decode_rate_is_forwards_per_second_of_the_decode_phase():
    assert decode_rate(SimpleNamespace(token_ids=(5, 6, 7, 8, 9), timings={"decode_s": 2.0})) == 2.0
    assert decode_rate(SimpleNamespace(token_ids=(5,), timings={"decode_s": 0.1})) is None


def test_fair_baselines_are_ratios_of_reuse_over_each_and_goals_at_the_largest_workspace():
    pts = points()
    for p, cache, floor in zip(pts, (1.0, 2.0), (0.9, 1.95)):
        p.update(prefix_ttft_s=cache, suffix_floor_s=floor)
        p.update(baseline_ratios(p))
    assert (pts[0]["ttft_vs_prefix_cache"], pts[0]["ttft_vs_suffix_floor"]) == pytest.approx((2.0, 2.0 / 0.9))
    assert pts[1]["ttft_speedup"] == pytest.approx(40.0) and pts[1]["ttft_vs_prefix_cache"] == pytest.approx(1.25)
    out = headline("llama.cpp", "m", pts, {})
    assert (out["ttft_vs_prefix_cache"], out["ttft_vs_suffix_floor"]) == pytest.approx((1.25, 2.5 / 1.95))
    met = goals({**out, "points": pts}, quick=True)
    # 2.5 s against a 2.0 s cache misses 1.2x; against 1.25 * (1.95 + 0.05) = 2.5 s the floor goal is just met
    assert met["ttft_vs_prefix_cache<=1.2"] is False and met["ttft<=1.25x(suffix_floor+50ms)"] is True
    assert "ttft_vs_prefix_cache<=1.2" not in goals({"ttft_speedup": 1.0}, quick=True)  # not measured: not a goal
    assert "vs cache" in table(pts).splitlines()[0]


def test_gpu_memory_is_reported_only_where_torch_holds_a_gpu() -> None:
    """A CPU-only machine's points carry no GPU memory keys; a point that has them shows them in the table."""
    import torch

    from kvmem_bench.speed_common import gpu_memory_mb, table

    if torch.cuda.is_available():
        pytest.skip("a CUDA machine reports its memory")
    assert gpu_memory_mb() == {}
    rows = table([{"workspace_tokens": 1024, "reuse_ttft_s": 0.5, "gpu_reserved_mb": 2048.0}])
    assert "gpu MB" in rows and "2048" in rows
