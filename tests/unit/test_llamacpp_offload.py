"""GPU offload decisions for llama.cpp, and the build lines the docs give.

No AMD GPU was available: the HIP cases use mocked device lists (``ROCm0`` is the name
llama.cpp's CUDA backend gives a device when built with HIP, ggml-cuda.h) and mocked
build options; the NVIDIA path runs for real under ``tests/gpu``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("llama_cpp")

from kvmem.install_plan import Gpu, llama_build  # noqa: E402
from kvmem_core.errors import ConfigError  # noqa: E402
from kvmem_llamacpp import offload  # noqa: E402
from kvmem_llamacpp.ggml import BackendDevice, backend_devices  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CPU = BackendDevice("CPU", "AMD EPYC", "cpu")
H200 = BackendDevice("CUDA0", "NVIDIA H200", "gpu")
MI300 = BackendDevice("ROCm0", "AMD Instinct MI300X", "gpu")


def test_device_names_map_to_runtimes() -> None:
    assert (CPU.runtime, H200.runtime, MI300.runtime) == ("cpu", "cuda", "hip")
    assert BackendDevice("Vulkan1", "x", "gpu").runtime == "vulkan" and not CPU.is_gpu and MI300.is_gpu


@pytest.mark.parametrize(
    "requested, can, expected",
    [(None, True, -1), (None, False, 0), (0, False, 0), (0, True, 0), (12, True, 12), (-1, True, -1)],
)
def test_gpu_layers_default_to_all_when_a_gpu_can_take_them(requested: int | None, can: bool, expected: int) -> None:
    assert offload.resolve_gpu_layers(requested, can, {}) == expected


def test_asking_for_gpu_layers_on_a_cpu_build_names_the_rebuild_lines() -> None:
    with pytest.raises(ConfigError, match="CPU-only") as err:
        offload.resolve_gpu_layers(-1, False, {"GGML_CUDA": "OFF", "GGML_HIP": "OFF"})
    assert "-DGGML_CUDA=on" in str(err.value) and "-DGGML_HIP=on" in str(err.value)
    with pytest.raises(ConfigError, match="must be -1"):
        offload.resolve_gpu_layers(-3, True, {})


def test_a_hip_build_without_a_device_says_so() -> None:  # mocked: no AMD hardware here
    why = offload.why_no_gpu({"GGML_CUDA": "OFF", "GGML_HIP": "ON"})
    assert "hip backend but sees no GPU" in why and "HIP_VISIBLE_DEVICES" in why


def test_placement_is_described_by_runtime_and_layers() -> None:
    assert offload.describe(0, 30, [CPU, H200]) == "cpu"
    assert offload.describe(-1, 30, [CPU, H200]) == "cuda: CUDA0 (NVIDIA H200), 30/30 layers"
    assert offload.describe(12, 30, [CPU, MI300]) == "hip: ROCm0 (AMD Instinct MI300X), 12/30 layers"
    assert offload.offload_runtime(-1, [CPU]) == "cpu" and offload.offload_runtime(-1, [MI300]) == "hip"


def test_the_installed_build_reports_its_options_and_devices() -> None:
    options = offload.build_options()
    assert {"GGML_CUDA", "GGML_HIP"} <= options.keys(), "ggml-config.cmake of the installed build not found"
    devices = backend_devices()
    assert any(d.kind == "cpu" for d in devices)
    assert offload.can_offload() == any(d.is_gpu for d in devices)
    if not offload.gpu_backends(options):
        assert not offload.can_offload()


def test_build_lines_use_options_this_llama_cpp_knows() -> None:
    """The docs' HIP line, the error's rebuild lines and ./kvmem's GPU builds carry flags of this build's CMake
    options."""
    docs = (ROOT / "docs" / "llamacpp.md").read_text()
    hip_line = next(line for line in docs.splitlines() if line.startswith('  CMAKE_ARGS="-DGGML_HIP=on'))
    assert offload.GPU_BUILD_FLAGS["hip"] in hip_line and 'HIPCXX="$(hipconfig -l)/clang"' in hip_line
    options = offload.build_options()
    one_click = [
        llama_build("x86_64", gpu, {}, run=lambda cmd: None)[0] for gpu in (Gpu("nvidia", "90"), Gpu("amd", "gfx1100"))
    ]
    for runtime, flags in [*offload.GPU_BUILD_FLAGS.items(), *zip(("cuda", "hip"), one_click)]:
        names = [flag[2:].split("=")[0] for flag in flags.split() if flag.startswith("-DGGML_")]
        assert names and all(name in options for name in names), (runtime, names)
    for runtime, flags in offload.GPU_BUILD_FLAGS.items():
        assert flags in offload.rebuild_command(runtime)


def test_the_build_leaves_out_amx_kernels() -> None:
    """``./kvmem`` builds llama.cpp for this machine's CPU without AMX: its AMX matrix kernels crash every process
    in the first ``llama_decode`` on AMX Xeons under some hypervisors (plain llama-cpp-python too). A build made
    with ``CMAKE_ARGS`` that puts AMX back fails here, by name, before the tests that would crash."""
    import llama_cpp

    assert "AMX_INT8 = 1" not in llama_cpp.llama_print_system_info().decode(), "llama.cpp was built with AMX"
