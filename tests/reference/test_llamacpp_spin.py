"""llama.cpp's OpenMP threads get the short spin when a process imports the engine, decode the same tokens as with
libgomp's own spin, and the busy bench's per-candidate process measures both conditions (SmolLM2, real llama.cpp)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from model_support import small_model

pytest.importorskip("llama_cpp")
if not sys.platform.startswith("linux"):
    pytest.skip("libgomp's environment display is checked on Linux", allow_module_level=True)

GREEDY = """
import sys
from kvmem.engines import adapter_factory
from kvmem_core.config import KVMemConfig

a = adapter_factory("llama.cpp")(sys.argv[1], KVMemConfig(ctx=4096, budget=1536, gen_budget=512))
ids = a.tokenize("The capital of France is")
out = []
for i in range(8):
    tokens, start = (ids, 0) if i == 0 else ([out[-1]], len(ids) + i - 1)
    out.append(int(a.forward(tokens, list(range(start, start + len(tokens)))).logits.argmax()))
print(out)
"""


def greedy_tokens(env: dict[str, str]) -> tuple[list[int], str]:
    """Eight greedy tokens of SmolLM2 on 2 threads in a fresh process with ``env`` added; libgomp's spin count as
    that process's OpenMP runtime reported it at load."""
    base = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    run = subprocess.run(
        [sys.executable, "-c", GREEDY, str(small_model())],
        env={**base, "KVMEM_THREADS": "2", "OMP_DISPLAY_ENV": "VERBOSE", **env},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    spin = next(line.split("=")[1].strip(" '") for line in run.stderr.splitlines() if "GOMP_SPINCOUNT" in line)
    return json.loads(run.stdout.strip().splitlines()[-1]), spin


def test_the_engine_shortens_the_spin_and_decodes_as_with_libgomps_own() -> None:
    short, spin = greedy_tokens({})
    assert spin == "300"
    long, user_spin = greedy_tokens({"GOMP_SPINCOUNT": "300000"})
    assert user_spin == "300000"  # a spin count the user set wins
    assert short == long and len(short) == 8


@pytest.mark.slow
def test_the_busy_bench_measures_one_candidate_in_a_process_of_its_own() -> None:
    from kvmem_bench.speed_threads_busy import child_figures

    figures = child_figures(str(small_model()), {"KVMEM_THREADS": "1"}, decode=2)
    assert figures["as is"] > 0 and figures["one core busy"] > 0
    assert set(figures["load_1min"]) == {"as is", "one core busy"}
