"""GPU offload of a llama.cpp model: how many layers go to the device, and why none can.

``n_gpu_layers``: None (the default) offloads every layer and the KV cache when this build
has a GPU backend and sees a device (``llama_supports_gpu_offload``), else runs on the CPU;
0 keeps everything on the CPU; N > 0 offloads the last N layers; -1 offloads all of them.
Asking for layers on a GPU where none can go raises ConfigError with the reason: a
CPU-only build (and the line that rebuilds it) or a GPU build that sees no device.

CUDA and HIP are one code path: llama.cpp builds its CUDA backend for AMD with HIP (the
devices are then named ``ROCm0``...), and KVMem reaches KV and activations only through
ggml's backend API, whichever backend holds them.
"""

from __future__ import annotations

import re
from pathlib import Path

import llama_cpp as L

from kvmem_core.errors import ConfigError
from kvmem_llamacpp.ggml import BackendDevice, backend_devices

ALL_LAYERS = -1
GPU_BUILD_FLAGS = {"cuda": "-DGGML_CUDA=on", "hip": "-DGGML_HIP=on -DGPU_TARGETS=gfx1100"}
GPU_OPTIONS = {"cuda": "GGML_CUDA", "hip": "GGML_HIP"}
REBUILD = {
    "cuda": 'CMAKE_ARGS="{flags}" pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36',
    "hip": 'CMAKE_ARGS="{flags}" HIPCXX="$(hipconfig -l)/clang" HIP_PATH="$(hipconfig -R)" '
    "pip install --force-reinstall --no-deps --no-cache-dir llama-cpp-python==0.3.36",
}
_SET = re.compile(r'^set\((GGML_[A-Z0-9_]+) "([^"]*)"\)$', re.M)


def rebuild_command(runtime: str) -> str:
    """The shell line that rebuilds llama-cpp-python 0.3.36 for ``cuda`` or ``hip`` (GPU_TARGETS: your gfx target)."""
    return REBUILD[runtime].format(flags=GPU_BUILD_FLAGS[runtime])


def build_options(config: Path | None = None) -> dict[str, str]:
    """The ``GGML_*`` CMake options the installed build was configured with (from its ``ggml-config.cmake``);
    empty when the file is missing."""
    path = config or Path(L.__file__).parent.parent / "lib" / "cmake" / "ggml" / "ggml-config.cmake"
    return dict(_SET.findall(path.read_text())) if path.is_file() else {}


def gpu_backends(options: dict[str, str]) -> list[str]:
    """The GPU runtimes (``cuda``, ``hip``) a build was configured with."""
    return [rt for rt, opt in GPU_OPTIONS.items() if options.get(opt, "OFF").upper() in ("ON", "1", "TRUE")]


def can_offload() -> bool:
    """True when this build has a GPU backend and it sees at least one device."""
    return bool(L.llama_supports_gpu_offload())


def resolve_gpu_layers(requested: int | None, offload: bool, options: dict[str, str] | None = None) -> int:
    """The ``n_gpu_layers`` to load with: see the module doc. ``offload``: ``can_offload()``."""
    if requested is None:
        return ALL_LAYERS if offload else 0
    if requested < ALL_LAYERS:
        raise ConfigError(f"--n-gpu-layers must be -1 (all), 0 (CPU) or a layer count, got {requested}")
    if requested != 0 and not offload:
        raise ConfigError(f"--n-gpu-layers {requested}: {why_no_gpu(build_options() if options is None else options)}")
    return requested


def why_no_gpu(options: dict[str, str]) -> str:
    """Why no layer can go to a GPU, and what to do about it."""
    built = gpu_backends(options)
    if built:
        return (
            f"this llama-cpp-python build has the {'/'.join(built)} backend but sees no GPU "
            "(check the driver and CUDA_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES)"
        )
    return (
        "this llama-cpp-python build is CPU-only; rebuild it for NVIDIA with "
        f"`{rebuild_command('cuda')}` or for AMD with `{rebuild_command('hip')}` (GPU_TARGETS: your gfx target)"
    )


def offload_runtime(n_gpu_layers: int, devices: list[BackendDevice] | None = None) -> str:
    """``cpu`` when nothing is offloaded, else the GPU runtime (``cuda``, ``hip``, ...) that holds the layers."""
    gpus = _gpus(devices)
    return gpus[0].runtime if n_gpu_layers != 0 and gpus else "cpu"


def describe(n_gpu_layers: int, n_layer: int, devices: list[BackendDevice] | None = None) -> str:
    """Where the model runs, for logs and stats: ``cpu`` or ``cuda: CUDA0 (NVIDIA H200), 30/30 layers``."""
    gpus = _gpus(devices)
    if offload_runtime(n_gpu_layers, gpus) == "cpu":
        return "cpu"
    layers = n_layer if n_gpu_layers == ALL_LAYERS else min(n_gpu_layers, n_layer)
    names = ", ".join(f"{d.name} ({d.description})" for d in gpus)
    return f"{gpus[0].runtime}: {names}, {layers}/{n_layer} layers"


def _gpus(devices: list[BackendDevice] | None) -> list[BackendDevice]:
    return [d for d in (backend_devices() if devices is None else devices) if d.is_gpu]
