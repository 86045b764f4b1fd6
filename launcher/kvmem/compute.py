"""The engine's compute flags: ``--threads`` and ``--threads-batch`` (both backends), ``--n-gpu-layers``
and ``--capture-context`` (llama.cpp), ``--dtype`` (torch: the precision weights and KV are held in;
llama.cpp computes in its file's own types).

Each reads its ``KVMEM_*`` variable when not given. Thread counts default to every core this
process may use (``kvmem_core.threads``); GPU layers to all of them when the llama.cpp build
has a GPU backend and sees a device (``kvmem_llamacpp.offload``). An explicit ``--device
cuda`` or ``hip`` makes the GPU a requirement: a CPU-only build then fails with the line
that rebuilds it, instead of running quietly on the CPU.
"""

from __future__ import annotations

import argparse
import os
from typing import Any

from kvmem.flags import parse_switch
from kvmem_core.errors import ConfigError
from kvmem_core.threads import THREADS_BATCH_ENV, THREADS_ENV, parse_count, resolve_threads, usable_cores

GPU_LAYERS_ENV = "KVMEM_N_GPU_LAYERS"
DTYPE_ENV = "KVMEM_DTYPE"
CAPTURE_CONTEXT_ENV = "KVMEM_CAPTURE_CONTEXT"
DTYPES = ("auto", "float32", "bfloat16", "float16")
ALL_LAYERS = -1


def add_compute_flags(parser: argparse.ArgumentParser) -> None:
    """Add ``--threads``, ``--threads-batch`` and ``--n-gpu-layers`` (defaults resolved later, env included)."""
    group = parser.add_argument_group("compute")
    group.add_argument(
        "--threads",
        type=_count("--threads"),
        default=None,
        metavar="N",
        help=f"CPU threads for decode steps (default: the {usable_cores()} cores this process may use; "
        f"env {THREADS_ENV})",
    )
    group.add_argument(
        "--threads-batch",
        type=_count("--threads-batch"),
        default=None,
        metavar="N",
        help=f"CPU threads for prefill batches (default: --threads; env {THREADS_BATCH_ENV})",
    )
    group.add_argument(
        "--n-gpu-layers",
        type=int,
        default=None,
        metavar="N",
        help="llama.cpp: layers offloaded to the GPU with their KV cache, -1 all, 0 none (default: all "
        f"when llama-cpp-python was built for a GPU and one is present; env {GPU_LAYERS_ENV})",
    )
    group.add_argument(
        "--capture-context",
        type=parse_switch,
        default=None,
        metavar="{on,off}",
        help="llama.cpp: capture retrieval queries in a second context, so the view's own decodes "
        "without an eval callback (which costs a small model ~6-10%% of its GPU decode); a "
        "retrieval step then copies the view there and back, and the view's KV is held twice "
        f"(default: on when layers are offloaded to a GPU, off on the CPU; env {CAPTURE_CONTEXT_ENV})",
    )
    group.add_argument(
        "--dtype",
        choices=DTYPES,
        default=None,
        help=f"torch: weights and KV precision (default auto: bfloat16 on a GPU, float32 on the CPU; env {DTYPE_ENV})",
    )


def compute_opts(args: argparse.Namespace, backend: str, device: str = "auto") -> dict[str, Any]:
    """The adapter options the flags ask for on ``backend``; ``device``: ``auto`` or what the user chose
    (``cpu``, ``cuda``, ``hip``). ConfigError on a contradiction (GPU layers with ``--device cpu``)."""
    threads = resolve_threads(getattr(args, "threads", None), getattr(args, "threads_batch", None))
    opts: dict[str, Any] = {"n_threads": threads.decode, "n_threads_batch": threads.batch}
    if backend == "llama.cpp":
        opts["n_gpu_layers"] = gpu_layers(getattr(args, "n_gpu_layers", None), device)
        choice = capture_context(getattr(args, "capture_context", None))
        if choice is not None:
            opts["capture_context"] = choice
    dtype = getattr(args, "dtype", None) or os.environ.get(DTYPE_ENV) or "auto"
    if dtype not in DTYPES:
        raise ConfigError(f"{DTYPE_ENV}={dtype!r}: choose from {', '.join(DTYPES)}")
    if backend == "torch" and dtype != "auto":
        opts["dtype"] = dtype
    return opts


def gpu_layers(flag: int | None, device: str) -> int | None:
    """``--n-gpu-layers`` (else ``KVMEM_N_GPU_LAYERS``) combined with the device choice; None: the adapter decides."""
    env = os.environ.get(GPU_LAYERS_ENV)
    if flag is None and env:
        try:
            flag = int(env)
        except ValueError:
            raise ConfigError(f"{GPU_LAYERS_ENV}={env!r}: want a layer count, -1 for all or 0") from None
    if device == "cpu":
        if flag:
            raise ConfigError(f"--n-gpu-layers {flag} contradicts --device cpu")
        return 0
    if device in ("cuda", "hip") and flag is None:
        return ALL_LAYERS  # the user asked for the GPU: fail loudly where it is missing
    return flag


def describe_compute(opts: dict[str, Any]) -> str:
    """One line for ``--dry-run`` and logs: ``threads 16 (batch 16), gpu layers all``."""
    line = f"threads {opts['n_threads']} (batch {opts['n_threads_batch']})" + (
        f", {opts['dtype']}" if "dtype" in opts else ""
    )
    if "n_gpu_layers" not in opts:
        return line
    layers = opts["n_gpu_layers"]
    line += f", gpu layers {'auto' if layers is None else 'all' if layers == ALL_LAYERS else layers}"
    capture = opts.get("capture_context")
    return line + ("" if capture is None else ", capture context " + ("on" if capture else "off"))


def capture_context(flag: bool | None) -> bool | None:
    """``--capture-context``, else ``KVMEM_CAPTURE_CONTEXT``, else None (the adapter decides by placement);
    ConfigError naming the variable when it holds neither on nor off."""
    raw = os.environ.get(CAPTURE_CONTEXT_ENV)
    if flag is not None or not raw:
        return flag
    try:
        return parse_switch(raw)
    except argparse.ArgumentTypeError as exc:
        raise ConfigError(f"{CAPTURE_CONTEXT_ENV}={raw!r}: {exc}") from None


def _count(flag: str) -> Any:
    def parse(text: str) -> int:
        try:
            return parse_count(text, flag)
        except ConfigError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse
