"""``kvmem_bench.first_step`` on the CPU (tiny random qwen35, SmolLM2's tokenizer): every part is timed, the CPU
adapter skips the warm-up, and the steps after it grow the session as the speed bench's do."""

from __future__ import annotations

import pytest

from kvmem_bench import first_step
from model_support import small_model


@pytest.mark.llamacpp  # SmolLM2's GGUF for the tokenizer
def test_a_start_is_timed_part_by_part():
    lines: list[str] = []
    out = first_step.run("tiny", str(small_model()), steps=2, device="cpu", log=lines.append)
    assert list(out) == ["load_s", "warm_up_s", "step0_s", "step1_s"]
    assert out["warm_up_s"] == 0.0 and out["load_s"] > 0 and min(out["step0_s"], out["step1_s"]) > 0
    assert len(lines) == 3 and lines[2].startswith("step 1: ")
