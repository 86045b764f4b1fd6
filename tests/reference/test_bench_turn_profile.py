"""``kvmem_bench.turn_profile`` on the CPU (tiny random qwen35, SmolLM2's tokenizer): one profile a size, each of a
turn past that size, with the engine's step in it; building the prompt timed turn by turn."""

from __future__ import annotations

import pstats

import pytest

from kvmem_bench import turn_profile
from model_support import small_model


@pytest.mark.llamacpp  # SmolLM2's GGUF for the tokenizer
def test_each_size_gets_the_profile_of_a_turn_past_it(tmp_path):
    done = turn_profile.run("tiny", str(small_model()), [900, 300], tmp_path, "cpu", lines=8, log=print)
    assert [tokens >= size for (tokens, _), size in zip(done, (300, 900))] == [True, True]
    assert done[0][0] < done[1][0] and all(ttft > 0 for _, ttft in done)
    for size in (300, 900):
        text = (tmp_path / f"{size}.txt").read_text()
        assert text.startswith("workspace ") and "engine.py" in text and "(step)" in text
        assert "_select" in str(pstats.Stats(str(tmp_path / f"{size}.prof")).stats)  # the whole profile, readable


@pytest.mark.llamacpp  # SmolLM2's GGUF for the tokenizer and template
def test_building_the_prompt_is_timed_turn_by_turn():
    tokens, seconds = turn_profile.prompt_seconds(str(small_model()), turns=3, timed=2, lines=8)
    assert tokens > 0 and len(seconds) == 2 and min(seconds) > 0


@pytest.mark.llamacpp  # SmolLM2's GGUF for the tokenizer
def test_a_traced_turn_charges_its_time_to_the_engine_phases_and_leaves_the_engine_as_it_was(tmp_path):
    from kvmem_bench.speed_ab import Session
    from kvmem_bench.speed_torch import DEFAULT_VIEW, session_engine
    from kvmem_bench.turn_trace import PHASES, traced

    engine = session_engine("tiny", str(small_model()), dict(DEFAULT_VIEW, sizes=(6000,), lines=8), "cpu")
    try:
        session = Session(engine, 8)
        while session.step()[0] < 3200:
            pass
        tokens, ttft = traced(engine, session.step, tmp_path, 900)
        assert not set(PHASES) & set(vars(engine)) and "_scorer" not in vars(engine)
        assert not {"forward", "drop"} & set(vars(engine.adapter)) and "take" not in vars(engine.checkpoints)
    finally:
        engine.close()
    lines = (tmp_path / "900.trace.txt").read_text().splitlines()
    assert lines[0] == f"workspace {tokens} tokens, TTFT {ttft:.3f} s"
    host = {line.split()[0]: float(line.split()[2]) for line in lines if line.startswith("kvmem.")}
    labels = {"kvmem._prefill", "kvmem._select", "kvmem.score", "kvmem.admit", "kvmem._decode", "kvmem.adapter.forward"}
    assert labels <= host.keys()
    assert "range  calls  host_ms  device_busy_ms  device_span_ms  device_idle_ms" in lines  # no device work here
    assert 0 < host["kvmem.score"] <= host["kvmem._select"] and host["kvmem._prefill"] <= ttft * 1000
    assert (tmp_path / "900.trace.json.gz").stat().st_size > 0


@pytest.mark.llamacpp  # SmolLM2's GGUF for the tokenizer
def test_the_collector_is_timed_pass_by_pass_over_the_engines_turns(tmp_path):
    import gc
    import json

    callbacks, threshold = list(gc.callbacks), gc.get_threshold()
    gc.set_threshold(50, 2, 1000)  # passes every few allocations: a turn this small would otherwise run none
    try:
        done = turn_profile.run("tiny", str(small_model()), [300], tmp_path, "cpu", lines=8, log=print, collector=True)
    finally:
        gc.set_threshold(*threshold)
    report = json.loads((tmp_path / "300.gc.json").read_text())
    assert report["tokens"] == done[0][0] >= 300 and report["turns"] == turn_profile.COLLECTOR_TURNS
    assert report["gen0"]["passes"] > report["gen1"]["passes"] > 0 and report["gen0"]["ms_a_turn"] > 0
    assert gc.callbacks == callbacks
