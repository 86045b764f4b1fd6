"""Which backend, device and GPU ``kvmem serve`` uses.

GPUs are listed through the vendors' tools: ``nvidia-smi`` (CSV query), ``amd-smi metric
--mem-usage --json`` and, on older ROCm, ``rocm-smi --showmeminfo vram --json``. The AMD
parsers are written from the tools' documented output and tested on samples of it; they
have not met AMD hardware. The choice:

- GPU: ``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` when set (the user chose);
  ``--gpu N``; else the only GPU, or the one with the most free memory; several equally
  free GPUs need ``--gpu``.
- device ``auto``: ``cuda`` on an NVIDIA GPU, ``hip`` on an AMD one, else ``cpu``.
- backend ``auto``: the native torch engine on a GPU when torch was built for that GPU
  (``torch.version.cuda`` / ``torch.version.hip``) and the engine is installed; llama.cpp
  otherwise.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

from kvmem.install_plan import run_tool
from kvmem_core.errors import ConfigError

BACKENDS = ("auto", "torch", "llama.cpp")
DEVICES = ("auto", "cpu", "cuda", "hip")
VISIBLE_ENV = {"nvidia": "CUDA_VISIBLE_DEVICES", "amd": "HIP_VISIBLE_DEVICES"}
EQUAL_FREE_FRACTION = 0.02
NVIDIA_QUERY = ["nvidia-smi", "--query-gpu=index,name,memory.total,memory.free", "--format=csv,noheader,nounits"]
AMD_SMI_QUERY = ["amd-smi", "metric", "--mem-usage", "--json"]
ROCM_SMI_QUERY = ["rocm-smi", "--showmeminfo", "vram", "--json"]
MIB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    total_mib: int
    free_mib: int
    vendor: str  # "nvidia" | "amd"


@dataclass(frozen=True)
class Placement:
    """The resolved engine placement; ``env`` goes to the engine process."""

    backend: str
    device: str
    gpu: Gpu | None
    reason: str
    env: dict[str, str] = field(default_factory=dict)


def parse_nvidia_smi(text: str) -> list[Gpu]:
    """Rows of ``nvidia-smi --query-gpu=index,name,memory.total,memory.free --format=csv,noheader,nounits``."""
    gpus = []
    for line in filter(None, (ln.strip() for ln in text.splitlines())):
        parts = [part.strip() for part in line.split(",")]
        name = ", ".join(parts[1:-2])
        gpus.append(Gpu(int(parts[0]), name, int(float(parts[-2])), int(float(parts[-1])), "nvidia"))
    return gpus


def parse_rocm_smi(text: str) -> list[Gpu]:
    """``rocm-smi --showmeminfo vram --json``:
    ``{"card0": {"VRAM Total Memory (B)": "...", "VRAM Total Used Memory (B)": "..."}}``."""
    gpus = []
    for card, fields in json.loads(text).items():
        if not card.startswith("card"):
            continue
        total = int(fields["VRAM Total Memory (B)"])
        used = int(fields["VRAM Total Used Memory (B)"])
        gpus.append(Gpu(int(card[4:]), fields.get("Card series", card), total // MIB, (total - used) // MIB, "amd"))
    return sorted(gpus, key=lambda g: g.index)


def parse_amd_smi(text: str) -> list[Gpu]:
    """``amd-smi metric --mem-usage --json``: a list of
    ``{"gpu": N, "mem_usage": {"total_vram": {"value", "unit"}, "free_vram": ...}}``.

    Older releases give bare numbers in MB instead of ``{"value", "unit"}`` objects.
    """
    data = json.loads(text)
    rows = data if isinstance(data, list) else data.get("gpu_data", [data])
    gpus = []
    for row in rows:
        mem = row["mem_usage"]
        gpus.append(
            Gpu(int(row["gpu"]), f"AMD GPU {row['gpu']}", _mib(mem["total_vram"]), _mib(mem["free_vram"]), "amd")
        )
    return sorted(gpus, key=lambda g: g.index)


def _mib(value: object) -> int:
    unit = "MB"
    if isinstance(value, dict):
        value, unit = value["value"], value.get("unit", "MB")
    scale = {"B": 1 / MIB, "KB": 1 / 1024, "MB": 1, "MIB": 1, "GB": 1024, "GIB": 1024}[str(unit).upper()]
    return int(float(value) * scale)  # type: ignore[arg-type]


Runner = Callable[[list[str]], str | None]


def probe_gpus(run: Runner = run_tool) -> list[Gpu]:
    """Every GPU the vendor tools report (NVIDIA first, then AMD through amd-smi or rocm-smi)."""
    for cmd, parse in (
        (NVIDIA_QUERY, parse_nvidia_smi),
        (AMD_SMI_QUERY, parse_amd_smi),
        (ROCM_SMI_QUERY, parse_rocm_smi),
    ):
        out = run(cmd)
        if out:
            try:
                gpus = parse(out)
            except (ValueError, KeyError, TypeError):
                continue
            if gpus:
                return gpus
    return []


def pick_gpu(gpus: list[Gpu], requested: int | None, env: dict[str, str]) -> tuple[Gpu | None, str]:
    """(the GPU to use, why); ConfigError when the choice is ambiguous or impossible."""
    if not gpus:
        if requested is not None:
            raise ConfigError(f"--gpu {requested}: no GPU found")
        return None, "no GPU found"
    visible = env.get(VISIBLE_ENV[gpus[0].vendor])
    if visible is not None and requested is None:
        return _by_index(gpus, visible.split(",")[0].strip(), "--gpu"), f"{VISIBLE_ENV[gpus[0].vendor]}={visible}"
    if requested is not None:
        return _by_index(gpus, str(requested), "--gpu"), f"--gpu {requested}"
    if len(gpus) == 1:
        return gpus[0], "the only GPU"
    ranked = sorted(gpus, key=lambda g: g.free_mib, reverse=True)
    best, second = ranked[0], ranked[1]
    if best.free_mib - second.free_mib <= EQUAL_FREE_FRACTION * max(best.total_mib, 1):
        raise ConfigError(
            f"{len(gpus)} GPUs with about equal free memory ({best.free_mib} MiB); choose one with --gpu N"
        )
    return best, f"most free memory ({best.free_mib} MiB of {best.total_mib})"


def _by_index(gpus: list[Gpu], index: str, flag: str) -> Gpu:
    for gpu in gpus:
        if str(gpu.index) == index:
            return gpu
    raise ConfigError(f"{flag} {index}: no such GPU (have {', '.join(str(g.index) for g in gpus)})")


def torch_gpu_runtime() -> str | None:
    """``cuda`` or ``hip`` when the installed torch was built for that GPU runtime and sees a device.

    Asked in a child process: importing torch loads numpy, and a CUDA build of llama.cpp loaded after numpy
    crashed in its model load (``kvmem.native_libs``), while torch failed to import after llama.cpp; the
    process that resolves the backend stays free of both until one is chosen."""
    if importlib.util.find_spec("torch") is None:
        return None
    probe = "import torch; print(('hip' if torch.version.hip else 'cuda') if torch.cuda.is_available() else '')"
    try:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired):
        return None
    answer = done.stdout.strip() if done.returncode == 0 else ""
    return answer or None


def resolve(
    backend: str,
    device: str,
    gpu: int | None,
    env: dict[str, str] | None = None,
    probe: Callable[[], list[Gpu]] = probe_gpus,
    torch_runtime: Callable[[], str | None] = torch_gpu_runtime,
    has_torch_engine: bool | None = None,
) -> Placement:
    """Resolve ``--backend``, ``--device`` and ``--gpu`` into one placement; ConfigError on a bad combination."""
    if backend not in BACKENDS:
        raise ConfigError(f"--backend must be one of {', '.join(BACKENDS)}")
    if device not in DEVICES:
        raise ConfigError(f"--device must be one of {', '.join(DEVICES)}")
    env = dict(os.environ if env is None else env)
    gpus = [] if device == "cpu" else probe()
    chosen, why = pick_gpu(gpus, gpu, env) if device != "cpu" else (None, "--device cpu")
    dev = (
        device if device != "auto" else ("cpu" if chosen is None else ("cuda" if chosen.vendor == "nvidia" else "hip"))
    )
    if dev != "cpu" and chosen is None:
        raise ConfigError(f"--device {dev}: no GPU found (nvidia-smi, amd-smi and rocm-smi report none)")
    if chosen is not None and dev != ("cuda" if chosen.vendor == "nvidia" else "hip"):
        raise ConfigError(f"--device {dev} but the GPU found is {chosen.vendor}")
    if has_torch_engine is None:
        has_torch_engine = importlib.util.find_spec("kvmem_torch") is not None
    if backend != "auto":
        chosen_backend = backend
    else:
        torch_ok = dev != "cpu" and has_torch_engine and torch_runtime() == dev
        chosen_backend = "torch" if torch_ok else "llama.cpp"
    extra = {}
    if chosen is not None and VISIBLE_ENV[chosen.vendor] not in env:
        extra[VISIBLE_ENV[chosen.vendor]] = str(chosen.index)
    return Placement(chosen_backend, dev, chosen, why, extra)
