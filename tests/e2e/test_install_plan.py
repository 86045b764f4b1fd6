"""``./kvmem``'s install plan: llama.cpp built for the GPU the vendor tools report, a wheel-cache key per build and
target, and torch only for a torch path, as the build for that GPU. GPUs are faked by scripts on PATH."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from kvmem.install_plan import cpu_target, plan

SCRIPT = Path(__file__).resolve().parents[2] / "launcher" / "kvmem" / "install_plan.py"
ROCMINFO = """*******
Agent 1
  Name:                    AMD Ryzen 9 7950X
  Device Type:             CPU
Agent 2
  Name:                    gfx1100
  Marketing Name:          Radeon RX 7900 XTX
  Device Type:             GPU
"""
X86 = "processor\t: 0\nflags\t\t: fpu sse2 avx2 avx512f\n"


def fake_tools(bin_dir: Path, tools: dict[str, str]) -> None:
    """Executable scripts named after ``tools`` that print their text."""
    bin_dir.mkdir(exist_ok=True)
    for name, text in tools.items():
        (bin_dir / name).write_text(f"#!/bin/sh\nexec /bin/cat <<'END'\n{text}\nEND\n")
        (bin_dir / name).chmod(0o755)


def run_plan(tmp_path: Path, tools: dict[str, str], *argv: str, **env: str) -> dict[str, str]:
    """The script's assignments, run as ``./kvmem`` runs it, with only the fake tools on PATH."""
    fake_tools(tmp_path / "bin", tools)
    base = {k: v for k, v in os.environ.items() if k not in ("CMAKE_ARGS", "KVMEM_BACKEND", "KVMEM_TORCH_INDEX")}
    done = subprocess.run(
        [sys.executable, str(SCRIPT), *argv],
        env=base | {"PATH": str(tmp_path / "bin")} | env,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    return dict(line.split("=", 1) for line in shlex.split(done.stdout.replace("\n", " ")))


def test_no_gpu_builds_for_the_cpu_and_installs_no_torch_to_serve(tmp_path: Path) -> None:
    found = run_plan(tmp_path, {}, "serve")
    assert "GGML_CUDA" not in found["LLAMA_CMAKE_ARGS"] and "GGML_HIP" not in found["LLAMA_CMAKE_ARGS"]
    assert found["LLAMA_DEVICE"] == "CPU" and found["TORCH_WHY"] == "" and found["TORCH_BUILD"] == ""


def test_an_nvidia_gpu_builds_cuda_for_its_compute_capability_and_serve_gets_cuda_torch(tmp_path: Path) -> None:
    found = run_plan(tmp_path, {"nvidia-smi": "9.0\n9.0"}, "serve", "--port", "8000")
    assert "-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=90" in found["LLAMA_CMAKE_ARGS"]
    assert found["LLAMA_TARGET"].endswith("-nvidia-90") and found["LLAMA_DEVICE"] == "nvidia 90"
    assert found["TORCH_BUILD"] == "CUDA" and found["TORCH_INDEX"] == "" and "NVIDIA GPU" in found["TORCH_WHY"]
    assert run_plan(tmp_path, {}, "serve", "--backend", "llama.cpp")["TORCH_WHY"] == ""


def test_an_amd_gpu_builds_hip_for_its_gfx_target_with_rocm_torch(tmp_path: Path) -> None:
    tools = {"rocminfo": ROCMINFO, "hipconfig": "/opt/rocm"}
    found = run_plan(tmp_path, tools, "run", "--backend=torch")
    assert "-DGGML_HIP=on -DGPU_TARGETS=gfx1100" in found["LLAMA_CMAKE_ARGS"]
    assert found["LLAMA_ENV"] == "HIP_PATH=/opt/rocm HIPCXX=/opt/rocm/clang"
    assert found["TORCH_BUILD"].startswith("ROCm ") and "/whl/rocm" in found["TORCH_INDEX"]
    assert found["TORCH_WHY"] == "--backend torch"


@pytest.mark.parametrize(
    "argv, why",
    [
        (("run", "-p", "hi"), ""),
        (("run", "--backend", "torch"), "--backend torch"),
        (("test",), "the tests run the torch engine"),
        (("models",), ""),
    ],
)
def test_torch_on_the_cpu_only_for_a_torch_path_and_as_the_cpu_build(
    tmp_path: Path, argv: tuple[str, ...], why: str
) -> None:
    found = run_plan(tmp_path, {}, *argv)
    assert found["TORCH_WHY"] == why
    assert (found["TORCH_BUILD"], found["TORCH_INDEX"]) == (
        ("CPU", "https://download.pytorch.org/whl/cpu") if why else ("", "")
    )


def test_the_cache_key_follows_flags_cpu_and_gpu() -> None:
    def key(cpuinfo: str = X86, env: dict[str, str] | None = None, nvidia: str | None = None) -> str:
        tools = {"nvidia-smi": nvidia} if nvidia else {}
        return plan(["run"], env or {}, run=lambda cmd: tools.get(cmd[0]), machine="x86_64", cpuinfo=cpuinfo)[
            "LLAMA_KEY"
        ]

    assert key() == key(X86.replace("avx2 avx512f", "avx512f avx2"))  # the flags' order does not matter
    assert (
        len(
            {
                key(),
                key(X86.replace(" avx512f", "")),
                key(nvidia="8.6"),
                key(nvidia="9.0"),
                key(env={"CMAKE_ARGS": "-DGGML_BLAS=on"}),
            }
        )
        == 5
    )
    assert cpu_target("aarch64", "Features\t: fp asimd sve\n").startswith("aarch64-")
