"""The few ggml functions KVMem calls directly, bound through ctypes to the libraries llama-cpp-python ships.

Tensor data may live in device memory once layers are offloaded, so it is read through the
backend API (``ggml_backend_tensor_get``), never through ``tensor->data``. The device
registry (``ggml_backend_dev_*``) says which devices this build can use.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import llama_cpp as L
import numpy as np
from llama_cpp._ctypes_extensions import load_shared_library

from kvmem_llamacpp.blob import GGML_TYPE_F32

_MAX_DIMS, _MAX_SRC, _MAX_OP_PARAMS, _MAX_NAME = 4, 10, 64, 64
DEVICE_KINDS = ("cpu", "gpu", "igpu", "accel", "meta")  # enum ggml_backend_dev_type, in order


class GgmlTensor(ctypes.Structure):
    """``struct ggml_tensor`` of the ggml vendored by llama-cpp-python 0.3.36 (ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _MAX_DIMS),
        ("nb", ctypes.c_size_t * _MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * (_MAX_OP_PARAMS // 4)),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * _MAX_SRC),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * _MAX_NAME),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


@dataclass(frozen=True)
class BackendDevice:
    """One device of ggml's registry: ``CPU``, ``CUDA0`` (NVIDIA), ``ROCm0`` (AMD through HIP), ..."""

    name: str
    description: str
    kind: str  # one of DEVICE_KINDS

    @property
    def runtime(self) -> str:
        """``cuda``, ``hip``, ``cpu`` or the lower-cased backend name (``vulkan``, ``metal``, ...)."""
        base = self.name.rstrip("0123456789")
        return {"CUDA": "cuda", "ROCm": "hip", "CPU": "cpu"}.get(base, base.lower())

    @property
    def is_gpu(self) -> bool:
        return self.kind in ("gpu", "igpu")


def _lib_dir() -> Path:
    return Path(L.__file__).parent / "lib"


@cache
def _base() -> ctypes.CDLL:
    lib = load_shared_library("ggml-base", _lib_dir())
    lib.ggml_op_name.restype, lib.ggml_op_name.argtypes = ctypes.c_char_p, [ctypes.c_int]
    lib.ggml_backend_tensor_get.restype = None
    lib.ggml_backend_tensor_get.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t]
    for fn, res in (
        ("ggml_backend_dev_name", ctypes.c_char_p),
        ("ggml_backend_dev_description", ctypes.c_char_p),
        ("ggml_backend_dev_type", ctypes.c_int),
    ):
        getattr(lib, fn).restype, getattr(lib, fn).argtypes = res, [ctypes.c_void_p]
    return lib


@cache
def _registry() -> ctypes.CDLL:
    lib = load_shared_library("ggml", _lib_dir())
    lib.ggml_backend_dev_count.restype, lib.ggml_backend_dev_count.argtypes = ctypes.c_size_t, []
    lib.ggml_backend_dev_get.restype, lib.ggml_backend_dev_get.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
    return lib


@cache
def op_id(name: str) -> int:
    """The ``enum ggml_op`` value whose name is ``name`` (e.g. ``ROPE``)."""
    return next(i for i in range(256) if _base().ggml_op_name(i) == name.encode())


def read_rows(t: GgmlTensor, t_ptr: int, first: int, out: np.ndarray) -> None:
    """Copy rows ``first:first + len(out)`` of a contiguous f32 tensor whose rows are ``out``'s width into
    ``out`` (a C-contiguous float32 [rows, width] array), wherever its buffer lives (host or device memory)."""
    assert t.type == GGML_TYPE_F32 and _is_contiguous(t), "expected a contiguous f32 tensor"
    assert out.dtype == np.float32 and out.flags.c_contiguous and out.ndim == 2
    assert (first + out.shape[0]) * out.shape[1] <= t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3], "rows past the tensor"
    _base().ggml_backend_tensor_get(t_ptr, out.ctypes.data, first * out.shape[1] * 4, out.nbytes)


def _is_contiguous(t: GgmlTensor) -> bool:
    stride = 4
    for i in range(_MAX_DIMS):
        if t.ne[i] > 1 and t.nb[i] != stride:
            return False
        stride *= t.ne[i]
    return True


def backend_devices() -> list[BackendDevice]:
    """Every device this llama-cpp-python build registered (after ``llama_backend_init``)."""
    reg, base = _registry(), _base()
    out = []
    for i in range(reg.ggml_backend_dev_count()):
        dev = reg.ggml_backend_dev_get(i)
        kind = base.ggml_backend_dev_type(dev)
        out.append(
            BackendDevice(
                base.ggml_backend_dev_name(dev).decode(),
                base.ggml_backend_dev_description(dev).decode(),
                DEVICE_KINDS[kind] if kind < len(DEVICE_KINDS) else "other",
            )
        )
    return out
