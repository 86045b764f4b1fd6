"""Backend, device and GPU choice. The AMD samples follow amd-smi's and rocm-smi's documented
JSON output; no AMD hardware ran them."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from kvmem import devices as D
from kvmem_core.errors import ConfigError

NVIDIA_CSV = "0, NVIDIA H200, 143771, 143156\n1, NVIDIA H200, 143771, 100000\n"
ROCM_SMI_JSON = json.dumps(
    {
        "card0": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "10850304"},
        "card1": {"VRAM Total Memory (B)": "68702699520", "VRAM Total Used Memory (B)": "34359738368"},
    }
)
AMD_SMI_JSON = json.dumps(
    [
        {
            "gpu": 0,
            "mem_usage": {
                "total_vram": {"value": 196592, "unit": "MB"},
                "used_vram": {"value": 283, "unit": "MB"},
                "free_vram": {"value": 196309, "unit": "MB"},
            },
        },
        {
            "gpu": 1,
            "mem_usage": {
                "total_vram": {"value": 196592, "unit": "MB"},
                "used_vram": {"value": 96592, "unit": "MB"},
                "free_vram": {"value": 100000, "unit": "MB"},
            },
        },
    ]
)
AMD_SMI_OLD_JSON = json.dumps([{"gpu": 0, "mem_usage": {"total_vram": 65520, "used_vram": 11, "free_vram": 65509}}])


def gpu(index: int, free: int, vendor: str = "nvidia", total: int = 100_000) -> D.Gpu:
    return D.Gpu(index, f"g{index}", total, free, vendor)


def test_parse_nvidia_smi() -> None:
    assert D.parse_nvidia_smi(NVIDIA_CSV) == [
        D.Gpu(0, "NVIDIA H200", 143771, 143156, "nvidia"),
        D.Gpu(1, "NVIDIA H200", 143771, 100000, "nvidia"),
    ]


def test_parse_rocm_smi() -> None:
    gpus = D.parse_rocm_smi(ROCM_SMI_JSON)
    assert [(g.index, g.total_mib, g.free_mib, g.vendor) for g in gpus] == [
        (0, 65520, 65509, "amd"),
        (1, 65520, 32752, "amd"),
    ]


def test_parse_amd_smi_new_and_old_formats() -> None:
    assert [(g.index, g.total_mib, g.free_mib) for g in D.parse_amd_smi(AMD_SMI_JSON)] == [
        (0, 196592, 196309),
        (1, 196592, 100000),
    ]
    assert [(g.index, g.total_mib, g.free_mib) for g in D.parse_amd_smi(AMD_SMI_OLD_JSON)] == [(0, 65520, 65509)]


def test_probe_prefers_nvidia_then_amd_smi_then_rocm_smi() -> None:
    outputs = {"nvidia-smi": None, "amd-smi": "not json", "rocm-smi": ROCM_SMI_JSON}
    assert [g.vendor for g in D.probe_gpus(lambda cmd: outputs[cmd[0]])] == ["amd", "amd"]
    assert D.probe_gpus(lambda cmd: None) == []


def test_pick_gpu_rules() -> None:
    assert D.pick_gpu([gpu(0, 5)], None, {})[0] == gpu(0, 5)
    assert D.pick_gpu([gpu(0, 10_000), gpu(1, 90_000)], None, {})[0].index == 1
    assert D.pick_gpu([gpu(0, 90_000), gpu(1, 10_000)], 1, {})[0].index == 1
    chosen, why = D.pick_gpu([gpu(0, 90_000), gpu(1, 10_000)], None, {"CUDA_VISIBLE_DEVICES": "1"})
    assert chosen.index == 1 and why == "CUDA_VISIBLE_DEVICES=1"
    assert D.pick_gpu([gpu(0, 5, "amd"), gpu(1, 90_000, "amd")], None, {"HIP_VISIBLE_DEVICES": "0"})[0].index == 0
    assert D.pick_gpu([], None, {}) == (None, "no GPU found")


def test_pick_gpu_asks_on_equal_gpus_and_refuses_unknown_ones() -> None:
    with pytest.raises(ConfigError, match="--gpu"):
        D.pick_gpu([gpu(0, 80_000), gpu(1, 80_500)], None, {})
    with pytest.raises(ConfigError, match="no such GPU"):
        D.pick_gpu([gpu(0, 1)], 3, {})
    with pytest.raises(ConfigError, match="no GPU found"):
        D.pick_gpu([], 0, {})


def resolve(
    backend: str = "auto",
    device: str = "auto",
    gpus: list[D.Gpu] | None = None,
    runtime: str | None = None,
    torch_engine: bool = True,
    env: dict[str, str] | None = None,
) -> D.Placement:
    return D.resolve(
        backend,
        device,
        None,
        env or {},
        probe=lambda: gpus or [],
        torch_runtime=lambda: runtime,
        has_torch_engine=torch_engine,
    )


def test_resolve_on_a_cpu_machine_picks_llama_cpp() -> None:
    p = resolve()
    assert (p.backend, p.device, p.gpu, p.env) == ("llama.cpp", "cpu", None, {})


def test_resolve_prefers_torch_on_a_gpu_it_was_built_for() -> None:
    p = resolve(gpus=[gpu(0, 9)], runtime="cuda")
    assert (p.backend, p.device, p.env) == ("torch", "cuda", {"CUDA_VISIBLE_DEVICES": "0"})
    assert resolve(gpus=[gpu(0, 9)], runtime=None).backend == "llama.cpp"
    assert resolve(gpus=[gpu(0, 9)], runtime="cuda", torch_engine=False).backend == "llama.cpp"


def test_resolve_detects_rocm() -> None:
    p = resolve(gpus=[gpu(0, 9, "amd")], runtime="hip")
    assert (p.backend, p.device, p.env) == ("torch", "hip", {"HIP_VISIBLE_DEVICES": "0"})
    assert resolve(gpus=[gpu(0, 9, "amd")], runtime="cuda").backend == "llama.cpp"


def test_resolve_keeps_the_users_visible_devices_and_honours_explicit_choices() -> None:
    assert resolve(gpus=[gpu(0, 9)], env={"CUDA_VISIBLE_DEVICES": "0"}).env == {}
    assert resolve(device="cpu", gpus=[gpu(0, 9)], runtime="cuda").device == "cpu"
    assert resolve(backend="llama.cpp", gpus=[gpu(0, 9)], runtime="cuda").backend == "llama.cpp"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"device": "cuda"}, "no GPU found"),
        ({"device": "hip", "gpus": [gpu(0, 9)]}, "nvidia"),
        ({"backend": "vllm"}, "--backend"),
        ({"device": "tpu"}, "--device"),
    ],
)
def test_resolve_refuses_impossible_combinations(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        resolve(**kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "backend, device, expected",
    [("torch", "cpu", "cpu"), ("torch", "cuda", "cuda"), ("torch", "hip", "cuda"), ("llama.cpp", "cpu", None)],
)
def test_the_engine_runs_on_the_resolved_device(backend, device, expected):
    from kvmem.serve_config import engine_opts

    args = argparse.Namespace(device=device, threads=3, threads_batch=2, n_gpu_layers=None)
    opts = engine_opts(args, D.Placement(backend, device, None, "test"), progress=False)
    assert opts.get("device") == expected and opts["progress"] is False
    assert (opts["n_threads"], opts["n_threads_batch"]) == (3, 2)


@pytest.mark.parametrize("asked, expected", [("cpu", 0), ("cuda", -1), ("hip", -1), ("auto", None)])
def test_llamacpp_offloads_to_the_gpu_the_user_named(asked: str, expected: int | None) -> None:
    """An explicit --device cuda/hip requires every layer on the GPU; an automatic choice lets the adapter decide."""
    from kvmem.serve_config import engine_opts

    args = argparse.Namespace(device=asked, threads=None, threads_batch=None, n_gpu_layers=None)
    placement = D.Placement("llama.cpp", "cuda" if asked == "auto" else asked, None, "test")
    assert engine_opts(args, placement, progress=False)["n_gpu_layers"] == expected


def test_an_explicit_backend_never_asks_torch() -> None:
    def refuse() -> str | None:
        raise AssertionError("torch asked although the backend was chosen")

    for backend in ("llama.cpp", "torch"):
        p = D.resolve(backend, "auto", None, {}, probe=lambda: [gpu(0, 9)], torch_runtime=refuse)
        assert (p.backend, p.device) == (backend, "cuda")


def test_asking_torch_keeps_it_out_of_the_launcher_process() -> None:
    """torch (and numpy with it) in the process that then loads a CUDA llama.cpp crashed its model load: the
    question is asked in a child process."""
    code = "import sys; from kvmem.devices import torch_gpu_runtime as t; r = t(); print(r, 'torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr
    runtime, imported = out.stdout.split()
    assert imported == "False"
    assert runtime in ("None", "cuda", "hip")
