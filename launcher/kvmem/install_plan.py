"""What ``./kvmem`` installs on this machine: the llama.cpp build and its wheel-cache key, and torch only when asked
for.

Runs before the virtual environment exists (``python3 launcher/kvmem/install_plan.py ARGS...``), so it
imports the standard library only. It prints shell assignments that ``./kvmem`` evaluates:

* ``LLAMA_CMAKE_ARGS``, ``LLAMA_ENV``: llama-cpp-python's build. An NVIDIA GPU (``nvidia-smi``) builds
  CUDA for its compute capability, an AMD one (``rocminfo``) HIP for its gfx target; the CPU part is
  native, without AMX on x86-64 (its kernels crash under some hypervisors). ``CMAKE_ARGS`` replaces
  the flags.
* ``LLAMA_TARGET``, ``LLAMA_KEY``: the CPU (architecture and instruction-set flags) and GPU the build is
  for, and the wheel cache's folder name, a hash of flags and target, so a cache shared between
  machines never hands one CPU's native build to another.
* ``TORCH_BUILD``, ``TORCH_INDEX``, ``TORCH_WHY``: torch, only for ``--backend torch``, for ``serve``'s
  ``auto`` backend on a GPU, or for ``test``; the CUDA or ROCm build by the GPU found, the CPU build
  otherwise. ``KVMEM_TORCH_INDEX`` replaces the package index.
"""

from __future__ import annotations

import hashlib
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
ROCM_INDEX = "https://download.pytorch.org/whl/rocm{}"
ROCM_VERSION_FILE = Path("/opt/rocm/.info/version")

Runner = Callable[[list[str]], "str | None"]


@dataclass(frozen=True)
class Gpu:
    """The GPU a build targets: ``vendor`` ``nvidia`` (``arch`` a compute capability such as ``90``) or ``amd``
    (``arch`` a gfx target such as ``gfx1100``)."""

    vendor: str
    arch: str


def run_tool(cmd: list[str]) -> str | None:
    """The tool's stdout, or None when it is missing, fails or hangs (here and in ``kvmem.devices``)."""
    if shutil.which(cmd[0]) is None:
        return None
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def find_gpu(run: Runner = run_tool) -> Gpu | None:
    """The first NVIDIA GPU ``nvidia-smi`` lists, else the first AMD gfx agent ``rocminfo`` lists, else None."""
    out = run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"])
    caps = re.findall(r"^\s*(\d+)\.(\d+)\s*$", out or "", re.M)
    if caps:
        return Gpu("nvidia", "".join(caps[0]))
    targets = re.findall(r"\bName:\s+(gfx[0-9a-f]+)\b", run(["rocminfo"]) or "")
    return Gpu("amd", targets[0]) if targets else None


def cpu_target(machine: str, cpuinfo: str) -> str:
    """``x86_64-<hash>``: the architecture and a hash of the first CPU's instruction-set flags (the native
    build uses every one of them)."""
    flags = re.search(r"^(?:flags|Features)\s*:\s*(.*)$", cpuinfo, re.M)
    features = " ".join(sorted(flags.group(1).split())) if flags else ""
    return f"{machine}-{hashlib.sha256(features.encode()).hexdigest()[:8]}"


def llama_build(
    machine: str, gpu: Gpu | None, env: Mapping[str, str], run: Runner = run_tool
) -> tuple[str, dict[str, str]]:
    """(the CMake arguments, extra build environment) for llama-cpp-python on this machine."""
    extra: dict[str, str] = {}
    if gpu is not None and gpu.vendor == "amd":
        root = (run(["hipconfig", "-R"]) or "").strip()
        clang = (run(["hipconfig", "-l"]) or "").strip()
        extra = {"HIP_PATH": root} if root else {}
        extra |= {"HIPCXX": f"{clang}/clang"} if clang else {}
    if "CMAKE_ARGS" in env:
        return env["CMAKE_ARGS"], extra
    args = [f"-DCMAKE_C_FLAGS='{NO_AMX}'", f"-DCMAKE_CXX_FLAGS='{NO_AMX}'"] if machine in ("x86_64", "amd64") else []
    if gpu is not None and gpu.vendor == "nvidia":
        args += ["-DGGML_CUDA=on", f"-DCMAKE_CUDA_ARCHITECTURES={gpu.arch}"]
    elif gpu is not None:
        args += ["-DGGML_HIP=on", f"-DGPU_TARGETS={gpu.arch}"]
    return " ".join(args), extra


def torch_reason(argv: Sequence[str], gpu: Gpu | None, env: Mapping[str, str]) -> str | None:
    """Why this command needs torch, or None when it does not."""
    command = next((a for a in argv if not a.startswith("-")), "")
    backend = _flag_value(argv, "--backend") or (env.get("KVMEM_BACKEND", "auto") if command == "serve" else None)
    if command == "test":
        return "the tests run the torch engine"
    if backend == "torch":
        return "--backend torch"
    if command == "serve" and backend == "auto" and gpu is not None:
        return f"serve's auto backend picks the torch engine on the {gpu.vendor.upper()} GPU found"
    return None


def _flag_value(argv: Sequence[str], flag: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(flag + "="):
            return arg.split("=", 1)[1]
    return None


def torch_build(gpu: Gpu | None, env: Mapping[str, str], rocm_version: str | None) -> tuple[str, str]:
    """(the build's name, the extra package index it comes from; empty: PyPI's own, which is CUDA on Linux)."""
    if gpu is None:
        return "CPU", env.get("KVMEM_TORCH_INDEX", TORCH_CPU_INDEX)
    if gpu.vendor == "nvidia":
        return "CUDA", env.get("KVMEM_TORCH_INDEX", "")
    series = ".".join((rocm_version or "6.4").split(".")[:2])
    return f"ROCm {series}", env.get("KVMEM_TORCH_INDEX", ROCM_INDEX.format(series))


def plan(
    argv: Sequence[str],
    env: Mapping[str, str],
    run: Runner = run_tool,
    machine: str | None = None,
    cpuinfo: str | None = None,
    rocm_version: str | None = None,
) -> dict[str, str]:
    """Every variable ``./kvmem`` reads, for the command line ``argv`` on this machine."""
    machine = machine or platform.machine().lower()
    cpuinfo = _read("/proc/cpuinfo") if cpuinfo is None else cpuinfo
    gpu = find_gpu(run)
    cmake_args, build_env = llama_build(machine, gpu, env, run)
    target = cpu_target(machine, cpuinfo) + ("" if gpu is None else f"-{gpu.vendor}-{gpu.arch}")
    key = hashlib.sha256(f"{cmake_args}\n{target}".encode()).hexdigest()[:12]
    reason = torch_reason(argv, gpu, env)
    build, index = torch_build(gpu, env, rocm_version or _read(ROCM_VERSION_FILE).strip() or None)
    return {
        "LLAMA_CMAKE_ARGS": cmake_args,
        "LLAMA_ENV": " ".join(f"{k}={v}" for k, v in build_env.items()),
        "LLAMA_TARGET": target,
        "LLAMA_KEY": key,
        "LLAMA_DEVICE": "CPU" if gpu is None else f"{gpu.vendor} {gpu.arch}",
        "TORCH_BUILD": build if reason else "",
        "TORCH_INDEX": index if reason else "",
        "TORCH_WHY": reason or "",
    }


def _read(path: str | Path) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def main(argv: list[str]) -> int:
    for name, value in plan(argv, os.environ).items():
        print(f"{name}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
