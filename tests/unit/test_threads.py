"""Thread counts and the compute flags: defaults from the affinity mask, env, explicit values, refusals."""

from __future__ import annotations

import argparse

import pytest

from kvmem.compute import add_compute_flags, compute_opts, describe_compute, gpu_layers
from kvmem_core.errors import ConfigError
from kvmem_core.threads import Threads, resolve_threads, usable_cores


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_compute_flags(parser)
    return parser.parse_args(list(argv))


def test_unset_counts_take_every_core_this_process_may_use(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 2, 5})
    assert usable_cores() == 3
    assert resolve_threads(env={}) == Threads(3, 3, auto=True)  # and the engine follows the free cores


@pytest.mark.parametrize(
    "threads, batch, env, expected",
    [
        (None, None, {"KVMEM_THREADS": "4"}, Threads(4, 4)),
        (None, None, {"KVMEM_THREADS": "4", "KVMEM_THREADS_BATCH": "8"}, Threads(4, 8)),
        (2, None, {"KVMEM_THREADS": "4"}, Threads(2, 2)),
        (2, 6, {"KVMEM_THREADS_BATCH": "8"}, Threads(2, 6)),
    ],
)
def test_explicit_counts_beat_the_environment(
    threads: int | None, batch: int | None, env: dict[str, str], expected: Threads
) -> None:
    assert resolve_threads(threads, batch, env=env) == expected


@pytest.mark.parametrize("env", [{"KVMEM_THREADS": "0"}, {"KVMEM_THREADS": "many"}, {"KVMEM_THREADS_BATCH": "-2"}])
def test_bad_environment_counts_are_refused_with_the_variable_named(env: dict[str, str]) -> None:
    with pytest.raises(ConfigError, match=next(iter(env))):
        resolve_threads(env=env)


def test_flags_reach_the_adapter_options() -> None:
    opts = compute_opts(parse("--threads", "6", "--threads-batch", "12", "--n-gpu-layers", "10"), "llama.cpp")
    assert opts == {"n_threads": 6, "n_threads_batch": 12, "n_gpu_layers": 10}
    assert describe_compute(opts) == "threads 6 (batch 12), gpu layers 10"
    torch_opts = compute_opts(parse("--threads", "6", "--threads-batch", "12"), "torch")
    assert torch_opts == {"n_threads": 6, "n_threads_batch": 12}
    assert describe_compute(torch_opts) == "threads 6 (batch 12)"


def test_dtype_goes_to_the_torch_engine_only(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = compute_opts(parse("--threads", "2", "--threads-batch", "2", "--dtype", "float32"), "torch")
    assert opts["dtype"] == "float32" and describe_compute(opts) == "threads 2 (batch 2), float32"
    assert "dtype" not in compute_opts(parse("--threads", "2", "--dtype", "float32"), "llama.cpp")
    assert "dtype" not in compute_opts(parse("--threads", "2"), "torch")  # auto: the adapter picks by device
    monkeypatch.setenv("KVMEM_DTYPE", "float16")
    assert compute_opts(parse("--threads", "2"), "torch")["dtype"] == "float16"
    monkeypatch.setenv("KVMEM_DTYPE", "fp8")
    with pytest.raises(ConfigError, match="KVMEM_DTYPE='fp8'"):
        compute_opts(parse("--threads", "2"), "torch")
    with pytest.raises(SystemExit):
        parse("--dtype", "fp8")


def test_a_zero_thread_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse("--threads", "0")
    assert "--threads must be at least 1" in capsys.readouterr().err


def test_gpu_layers_follow_flag_env_and_device(monkeypatch: pytest.MonkeyPatch) -> None:
    assert gpu_layers(None, "auto") is None  # the adapter decides from the build and the devices
    assert gpu_layers(None, "cuda") == gpu_layers(None, "hip") == -1
    assert gpu_layers(12, "cuda") == 12 and gpu_layers(None, "cpu") == gpu_layers(0, "cpu") == 0
    monkeypatch.setenv("KVMEM_N_GPU_LAYERS", "7")
    assert gpu_layers(None, "auto") == 7 and gpu_layers(3, "auto") == 3
    with pytest.raises(ConfigError, match="contradicts --device cpu"):
        gpu_layers(None, "cpu")
    monkeypatch.setenv("KVMEM_N_GPU_LAYERS", "all")
    with pytest.raises(ConfigError, match="KVMEM_N_GPU_LAYERS"):
        gpu_layers(None, "auto")


def test_the_capture_context_is_a_llama_cpp_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    opts = compute_opts(
        parse("--threads", "2", "--threads-batch", "2", "--n-gpu-layers", "-1", "--capture-context", "on"), "llama.cpp"
    )
    assert opts["capture_context"] is True
    assert describe_compute(opts) == "threads 2 (batch 2), gpu layers all, capture context on"
    assert "capture_context" not in compute_opts(parse("--threads", "2"), "llama.cpp")  # the adapter decides
    assert "capture_context" not in compute_opts(parse("--threads", "2", "--capture-context", "on"), "torch")
    monkeypatch.setenv("KVMEM_CAPTURE_CONTEXT", "on")
    assert compute_opts(parse("--threads", "2"), "llama.cpp")["capture_context"] is True
    assert compute_opts(parse("--threads", "2", "--capture-context", "off"), "llama.cpp")["capture_context"] is False
    monkeypatch.setenv("KVMEM_CAPTURE_CONTEXT", "yes")
    with pytest.raises(ConfigError, match="KVMEM_CAPTURE_CONTEXT='yes'"):
        compute_opts(parse("--threads", "2"), "llama.cpp")
