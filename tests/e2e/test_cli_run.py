"""``kvmem run`` on bad input: one line on stderr, a non-zero exit, nothing stored lost."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from model_support import SMALL_MODEL, small_model

ROOT = Path(__file__).resolve().parents[2]


def kvmem(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(
        [sys.executable, "-m", "kvmem", *args], capture_output=True, text=True, cwd=ROOT, env=full_env, timeout=300
    )


def one_line_error(out: subprocess.CompletedProcess[str], needle: str) -> None:
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvmem: "), out.stderr
    assert needle in lines[0]


def test_no_subcommand_prints_usage():
    out = kvmem()
    assert out.returncode == 2 and out.stderr.startswith("usage: kvmem")


def test_run_help_lists_every_flag_with_default_and_env():
    out = kvmem("run", "--help")
    assert out.returncode == 0
    for flag, env in (
        ("--ctx", "KVMEM_CTX"),
        ("--kvmem-budget", "KVMEM_BUDGET"),
        ("--kvmem-positions", "KVMEM_POSITIONS"),
    ):
        assert flag in out.stdout and env in out.stdout
    assert "--json" in out.stdout and "--model" in out.stdout and "(default: 2048" in out.stdout


def test_unknown_model_path(tmp_path):
    one_line_error(kvmem("run", "-p", "hi", "--model", str(tmp_path / "missing.gguf")), "model file not found")


def test_non_gguf_file(tmp_path):
    bad = tmp_path / "notes.gguf"
    bad.write_text("plain text, not a model")
    one_line_error(kvmem("run", "-p", "hi", "--model", str(bad)), "is not a GGUF file")


@pytest.mark.llamacpp
def test_recurrent_architecture_is_refused(tmp_path):
    pytest.importorskip("llama_cpp")
    gguf = pytest.importorskip("gguf")
    import numpy as np

    path = tmp_path / "tiny-mamba.gguf"
    w = gguf.GGUFWriter(str(path), "mamba")
    w.add_block_count(2)
    w.add_context_length(256)
    w.add_embedding_length(64)
    w.add_tokenizer_model("no_vocab")
    w.add_tensor("token_embd.weight", np.zeros((32, 64), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    one_line_error(
        kvmem("run", "-p", "hi", "--model", str(path)), "recurrent/hybrid models are not supported by this adapter yet"
    )


@pytest.mark.llamacpp
def test_prompt_beyond_ctx_and_mandatory_over_budget_keep_stored_blocks(tmp_path):
    pytest.importorskip("llama_cpp")
    small_model()
    env = {"KVMEM_NVME_DIR": str(tmp_path / "nvme"), "KVMEM_BLOCK_TOKENS": "32", "KVMEM_MODEL": SMALL_MODEL}
    ok = kvmem("run", "-p", "Count from one to twenty: one, two, three, four, five, six.", "-n", "4", "--json", env=env)
    assert ok.returncode == 0, ok.stderr
    result = json.loads(ok.stdout)
    assert len(result["ids"]) == 4 and result["stats"]["prompt_tokens"] > 32
    assert (result["stats"]["backend"], result["stats"]["device"]) == ("llama.cpp", "cpu")  # what it chose
    stored = sorted(p.name for p in (tmp_path / "nvme").rglob("*") if p.is_file())
    assert stored
    one_line_error(kvmem("run", "-p", "word " * 200, "--ctx", "64", env=env), "--ctx is 64")
    system = "Always follow these rules. " * 120
    one_line_error(
        kvmem(
            "run",
            "-p",
            "hi",
            "--system",
            system,
            "--kvmem-budget",
            "512",
            "--kvmem-sink-tokens",
            "32",
            "--kvmem-recent-tokens",
            "64",
            env=env,
        ),
        "--kvmem-budget is 512",
    )
    assert sorted(p.name for p in (tmp_path / "nvme").rglob("*") if p.is_file()) == stored


@pytest.mark.parametrize(
    ("backend", "kv_dtype", "needle"),
    [
        ("llama.cpp", "fp8", "--kv-dtype fp8 is not available on the llama.cpp engine: choose f16 or q8_0"),
        ("torch", "q8_0", "--kv-dtype q8_0 is the llama.cpp engine's; the torch engine's 8-bit KV is fp8"),
    ],
)
def test_a_kv_dtype_the_engine_lacks_is_a_one_line_error(backend, kv_dtype, needle):
    pytest.importorskip("llama_cpp" if backend == "llama.cpp" else "torch")
    one_line_error(
        kvmem("run", "-p", "hi", "--model", str(small_model()), "--backend", backend, env={"KVMEM_KV_DTYPE": kv_dtype}),
        needle,
    )
