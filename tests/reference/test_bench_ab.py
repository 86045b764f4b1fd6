"""``kvmem_bench.speed_ab`` on the CPU (tiny random qwen35, SmolLM2's tokenizer): each feature's switch reaches the
part that reads it, and the turns alternate the two sides in both orders."""

from __future__ import annotations

import pytest

from kvmem_bench import speed_ab
from kvmem_core.engine import KVMemEngine
from model_support import small_model
from torch_tiny import random_qwen35_adapter


def test_each_switch_reaches_the_part_that_reads_it():
    adapter = random_qwen35_adapter("cpu", view_tokens=256, block_tokens=16)
    assert adapter.staged.device_summaries  # on by default (graphs: CUDA only)
    for on in (False, True):
        speed_ab.set_graphs(adapter, on)
        speed_ab.set_summaries(adapter, on)
        speed_ab.set_moves(adapter, on)
        assert adapter.model.rule_graphs.enabled is on
        assert adapter.staged.device_summaries is on
        assert adapter.caps.moves_cells is on
    adapter.close()


@pytest.mark.llamacpp  # SmolLM2's GGUF for the tokenizer
def test_the_turns_alternate_the_sides_and_the_host_summarizes_when_off(monkeypatch):
    seen, on_host = [], {True: 0, False: 0}
    set_summaries, host_summary = speed_ab.set_summaries, KVMemEngine._summarize
    monkeypatch.setitem(speed_ab.FEATURES, "summaries", lambda a, on: seen.append(on) or set_summaries(a, on))

    def counted(engine, kv, pos):
        if seen:
            on_host[seen[-1]] += 1
        return host_summary(engine, kv, pos)

    monkeypatch.setattr(KVMemEngine, "_summarize", counted)
    out = speed_ab.run(
        "summaries", "tiny", str(small_model()), workspace=600, rounds=2, device="cpu", lines=8, log=print
    )
    assert seen == [True, False, False, True]
    assert on_host[False] >= 2 * max(1, on_host[True]), on_host
    assert [t["summaries"] for t in out["turns"]] == seen
    assert out["median_ttft_on_s"] > 0 and out["median_ttft_off_s"] > 0 and out["device"] == "cpu"
    assert min(t["workspace_tokens"] for t in out["turns"]) >= 600
