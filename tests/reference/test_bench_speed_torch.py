"""The torch speed benchmark through KVMemEngine + TorchAdapter on a tiny random qwen35 with SmolLM2's tokenizer
and chat template (CPU): every figure present, consistent, and produced by the engine's steps."""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from model_support import small_model

from kvmem_bench.speed_common import floor_s
from kvmem_bench.speed_torch import run

PLAN = dict(
    sizes=(600, 1200),
    budget=512,
    recent=128,
    gen=128,
    lines=12,
    decode=4,
    stateless_max=600,
    hf=False,
    speculative_tokens=4,
    mtp=True,  # random weights with an MTP layer: the speculative rows add MTP's
)


@pytest.fixture(scope="module")
def result() -> dict:
    torch.set_num_threads(1)
    return run(quick=True, shape="tiny", plan=PLAN, tokenizer=str(small_model()), log=lambda line: None)


def test_contract_keys_and_headline_ratios(result: dict) -> None:
    assert result["backend"] == "torch" and result["model"] == "random-qwen35-tiny"
    first, last = result["points"]
    assert result["ttft_speedup"] == pytest.approx(first["reprefill_ttft_s"] / first["reuse_ttft_s"])
    assert result["decode_flatness"] == pytest.approx(last["kvmem_tok_s"] / first["kvmem_tok_s"])
    assert 0 < result["nvme_vs_raw"] and 0 < result["host_vs_raw"] and result["transfer"]["blocks"] > 0


def test_structured_output_on_the_torch_engine_parses_and_its_mask_is_timed(result: dict) -> None:
    structured = result["structured"]  # the same decode loop and grammar as llama.cpp's, over this tokenizer
    assert structured["parses"] and structured["tokens"] > 0 and structured["vocab"] >= 49152
    assert (
        0 < structured["mask_ms_per_token"]
        and structured["mask_alone_share"] > 0
        and "exposed_ms_per_token" in structured
    )


def test_points_are_engine_steps_that_reuse_the_workspace(result: dict) -> None:
    for size, p in zip(PLAN["sizes"], result["points"]):
        assert p["workspace_tokens"] >= size and p["method"] == "retrieval" and p["selected_blocks"] > 0
        assert p["prefill_tokens"] + p["cached_tokens"] == p["workspace_tokens"] and p["cached_tokens"] > 0
        assert p["reuse_ttft_s"] == pytest.approx(p["prefill_s"] + p["select_s"])
        assert p["select_s"] >= p["replay_s"] > 0
        assert p["decode_tokens"] == PLAN["decode"] - 1  # end-of-generation rows are zero: no step stops early
    last = result["points"][-1]
    assert last["cached_tokens"] > last["workspace_tokens"] // 2  # only the new turn was prefilled
    assert result["config"]["heads"] and result["config"]["budget"] == PLAN["budget"]


def test_decode_floors_use_the_view_and_the_whole_transcript(result: dict) -> None:
    kv, weights, copy = result["kv_bytes_per_token"], result["weights_GB"] * 1e9, result["bandwidths"]["hbm_copy_GBps"]
    assert kv == 1 * 2 * 2 * 256 * 4  # per token: 1 attention layer (of 4), K and V, 2 kv heads x 256, fp32
    for p in result["points"]:
        assert p["view_tokens"] == PLAN["budget"] + PLAN["gen"]
        floor = floor_s(weights + p["view_tokens"] * kv, copy)
        assert p["floor_tok_s"] == pytest.approx(1 / floor)
        assert p["fraction_of_floor"] == pytest.approx(p["kvmem_tok_s"] * floor)
        assert p["theoretical_ratio"] == pytest.approx(
            (weights + p["workspace_tokens"] * kv) / (weights + p["view_tokens"] * kv)
        )


def test_plain_engine_runs_up_to_its_limit(result: dict) -> None:
    first, last = result["points"]
    assert first["reprefill_ttft_s"] > 0 and first["full_tok_s"] > 0
    assert first["decode_vs_full"] == pytest.approx(first["kvmem_tok_s"] / first["full_tok_s"])
    assert first["fraction_of_theory"] == pytest.approx(first["decode_vs_full"] / first["theoretical_ratio"])
    assert last["reprefill_ttft_s"] is None and last["full_tok_s"] is None and last["ttft_speedup"] is None
    assert result["capacity"]["largest_dense_run"] == first["workspace_tokens"]


def test_each_turn_has_its_fair_baselines_ratios_split_and_goals(result: dict) -> None:
    for p in result["points"]:
        assert 0 < p["new_tokens"] <= p["prefill_tokens"] + p["workspace_tokens"] // 2
        assert p["prefix_ttft_s"] > 0 and p["suffix_floor_s"] > 0 and p["view_prefill_s"] > 0  # all fit on the CPU
        assert p["ttft_vs_prefix_cache"] == pytest.approx(p["reuse_ttft_s"] / p["prefix_ttft_s"])
        assert p["ttft_vs_suffix_floor"] == pytest.approx(p["reuse_ttft_s"] / p["suffix_floor_s"])
        assert p["view_chunk_tokens"] == 640 - 3 * 64  # KVMem's forwards: the view less its sink and one block
        assert p["view_resident_tokens"] == min(  # the streaming view starts full less one of them
            p["workspace_tokens"] - p["new_tokens"], PLAN["budget"] + PLAN["gen"] - p["view_chunk_tokens"]
        )
        parts = p["phases"]  # the turn's TTFT, phase by phase: they add up to it
        assert sum(parts.values()) == pytest.approx(p["reuse_ttft_s"], rel=1e-6)
        assert (
            parts["suffix_prefill_s"] > 0
            and parts["replay_s"] > 0
            and 0 < p["archive_host_s"] < parts["suffix_prefill_s"]
        )
        assert parts["checkpoint_s"] > 0  # qwen35's recurrent state is checkpointed at the query and the replay
        assert p["engine_prefill_vs_plain"] == pytest.approx(p["engine_prefill_tok_s"] / p["plain_prefill_tok_s"])
        assert set(p["goals"]) >= {
            "ttft<=1.25x(suffix_floor+50ms)",
            "ttft_vs_prefix_cache<=1.2",
            "view_prefill_vs_plain>=0.8",
            "engine_prefill_vs_plain>=0.8",
        }
        assert result["point_goals"][str(p["workspace_tokens"])] == p["goals"]
    assert result["ttft_vs_prefix_cache"] == result["points"][-1]["ttft_vs_prefix_cache"]


def test_a_tokenizer_only_gguf_is_refused_clearly_and_the_thread_sweep_skips_it(tmp_path) -> None:
    gguf = pytest.importorskip("gguf")
    from kvmem_bench import speed_threads
    from kvmem_core.errors import UnsupportedModelError
    from kvmem_torch.adapter import TorchAdapter

    path = tmp_path / "vocab.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_token_list(["a", "b"])
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    with pytest.raises(UnsupportedModelError, match="holds no weights"):
        TorchAdapter(path, view_tokens=256, device="cpu", progress=False)
    lines: list[str] = []
    swept = speed_threads.run("torch", str(path), {}, quick=True, log=lines.append)
    assert "holds no weights" in swept["skipped"] and "rows" not in swept and "not measured" in lines[0]


def test_the_session_figures_are_written_before_the_thread_sweep(result: dict, tmp_path, monkeypatch) -> None:
    """``run_speed`` writes the session's figures (here the module's run) before the thread sweep, which fails."""
    from kvmem_bench import speed, speed_threads, speed_torch

    def sweep_fails(*args, **kwargs):
        raise RuntimeError("thread sweep failed")

    monkeypatch.setattr(speed_torch, "run", lambda **opts: dict(result))
    monkeypatch.setattr(speed_threads, "run", sweep_fails)
    with pytest.raises(RuntimeError, match="thread sweep failed"):
        speed.run_speed("torch", str(small_model()), quick=True, out_dir=tmp_path, log=lambda line: None)
    written = json.loads((tmp_path / "speed.json").read_text())
    assert written["points"] == result["points"] and "threads" not in written
    head = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True).stdout
    meta = written["meta"]  # what produced the figures, written with them
    assert head.startswith(meta["commit"].removesuffix("-dirty")) and meta["machine"] and meta["date"]
    assert meta["command"] == "kvmem bench speed"  # called from Python: the bench's name alone


@pytest.mark.slow  # 30-100 s on a 2-vCPU machine: ./kvmem test --slow runs it
def test_tool_results_longer_than_the_view_stream_through_it_turn_after_turn() -> None:
    # ~1.7K-token turns through a 640-token view (512 budget, 128 reserve, 64-token blocks, 128 sink tokens): each
    # prefill forward must fit in what dropping every non-sink block frees, and the repeated steps of the bench
    # (the same request again) must find room for their replay
    torch.set_num_threads(1)
    plan = dict(PLAN, sizes=(1500, 3000), lines=60, decode=2, stateless_max=1)
    out = run(quick=True, shape="tiny", plan=plan, tokenizer=str(small_model()), log=lambda line: None)
    assert [p["prefill_tokens"] > 1500 for p in out["points"]] == [True, True]
    assert all(p["kvmem_tok_s"] > 0 for p in out["points"])


def test_the_speculative_rows_compare_lookup_and_mtp_with_off_on_every_turn(result: dict) -> None:
    rows = result["speculative"]  # random weights: what drafting and verifying cost, not what a real model gains
    turns = ["rewrite", "story", "edit_json", "explain"]
    assert [(row["mode"], row["turn"]) for row in rows] == [(m, t) for m in ("lookup", "mtp") for t in turns]
    for row in rows:
        mode = row["mode"]
        assert row["off_tok_s"] > 0 and row[f"{mode}_tok_s"] > 0
        assert row["speedup"] == pytest.approx(row[f"{mode}_tok_s"] / row["off_tok_s"], rel=0.01)
        assert row["same_answer"], f"{mode} is lossless: fp32 on the CPU answers as off does"


def test_the_kv_dtype_row_sets_fp8_against_bf16(result: dict) -> None:
    kv = result["kv_dtype"]  # on the CPU the sizes only: decode and staging are measured on CUDA
    assert kv["fp8"]["tokens_per_GiB"] >= 1.9 * kv["bf16"]["tokens_per_GiB"]
    assert kv["fp8"]["bytes_per_token"] < kv["bf16"]["bytes_per_token"] and "fp8_decode_speedup" not in kv
