"""``kvmem bench speed --json``: the last printed line is the contract's JSON object, files land in --out."""

from __future__ import annotations

import json

import pytest
from model_support import SMALL_MODEL, small_model

from test_cli_run import kvmem

from kvmem_core.config import KVMemConfig

CONTRACT = {"backend", "model", "ttft_speedup", "decode_flatness", "nvme_vs_raw", "host_vs_raw"}
pytestmark = pytest.mark.slow  # real prefills and decodes: tens of seconds each


def test_bench_speed_torch_json_last_line_and_files(tmp_path):
    out = kvmem("bench", "speed", "--backend", "torch", "--model", SMALL_MODEL, "--json", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert CONTRACT <= set(result) and result["backend"] == "torch" and result["model"] == "random-qwen35-tiny"
    assert all(isinstance(result[k], float) and result[k] > 0 for k in CONTRACT - {"backend", "model"})
    sizes = [p["workspace_tokens"] for p in result["points"]]
    assert len(sizes) == 2 and 1024 <= sizes[0] < 4096 <= sizes[1]  # the CPU plan, through the engine's steps
    assert sorted(p.name for p in tmp_path.iterdir()) == ["decode.png", "memory.png", "speed.json", "ttft.png"]
    written = json.loads((tmp_path / "speed.json").read_text())
    assert written["points"] == result["points"]
    command = f"kvmem bench speed --backend torch --model {SMALL_MODEL} --json --out {tmp_path}"
    assert written["meta"]["command"] == command  # what re-runs it


@pytest.mark.llamacpp
def test_llamacpp_session_measures_every_size_against_the_plain_engine():
    pytest.importorskip("llama_cpp")
    from kvmem_bench.speed_llamacpp import run

    plan = dict(sizes=(600, 1200), budget=512, recent=128, gen=128)
    result = run(str(small_model()), quick=True, decode_tokens=4, lines_per_turn=12, plan=plan, log=lambda s: None)
    assert CONTRACT <= set(result) and result["model"] == "SmolLM2-135M-Instruct.Q4_1"
    first, last = result["points"]
    assert 600 <= first["workspace_tokens"] < 1200 <= last["workspace_tokens"]
    assert last["cached_tokens"] > last["workspace_tokens"] // 2 and last["method"] == "retrieval"
    assert last["reprefill_ttft_s"] > last["reuse_ttft_s"] > 0 and last["full_tok_s"] > 0
    assert result["ttft_speedup"] == pytest.approx(last["reprefill_ttft_s"] / last["reuse_ttft_s"])
    assert last["select_s"] >= last["replay_s"] >= 0 and 1 <= last["decode_tokens"] <= 3
    t = result["transfer"]
    block = KVMemConfig.block_tokens
    assert t["bytes"] == t["blocks"] * 2 * 30 * block * 3 * 64 * 2  # K and V, 30 layers x block x 3 heads x 64, f16
    assert t["host_to_view_GBps"] > 0 and t["nvme_to_view_GBps"] > 0
    kv = result["kv_dtype"]
    assert 1.8 * kv["q8_0"]["bytes_per_token"] < kv["f16"]["bytes_per_token"]
