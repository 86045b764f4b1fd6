"""Pre-RoPE query capture through llama.cpp's eval callback (``cb_eval``).

The graph names a layer's query ``Qcur-<layer>`` three times: the projection, its 3-D
reshape (same memory) and the RoPE'd result. The first node with that name whose op is
not ROPE holds the content-frame query, float32 ``[tokens, heads * head_dim]``.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import llama_cpp as L
import numpy as np
from llama_cpp._ctypes_extensions import load_shared_library

_MAX_DIMS, _MAX_SRC, _MAX_OP_PARAMS, _MAX_NAME = 4, 10, 64, 64


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


def _rope_op_id() -> int:
    lib = load_shared_library("ggml-base", Path(L.__file__).parent / "lib")
    lib.ggml_op_name.restype = ctypes.c_char_p
    lib.ggml_op_name.argtypes = [ctypes.c_int]
    return next(i for i in range(256) if lib.ggml_op_name(i) == b"ROPE")


class QueryCapture:
    """Holds the eval callback; while ``armed`` it copies every layer's pre-RoPE queries."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int) -> None:
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self._rope = _rope_op_id()
        self._armed = False
        self._chunks = 0
        self._rows: dict[int, list[np.ndarray]] = {}
        self.callback = L.ggml_backend_sched_eval_callback(self._on_tensor)

    def arm(self) -> None:
        """Start collecting queries; call ``next_chunk`` before each ``llama_decode``."""
        self._rows = {il: [] for il in range(self.n_layer)}
        self._chunks = 0
        self._armed = True

    def next_chunk(self) -> None:
        self._chunks += 1

    def take(self, start: int) -> np.ndarray:
        """Queries of tokens ``start:`` of the last forward, float32 [layers, tokens, heads, head dim]; disarms."""
        self._armed = False
        assert all(len(r) == self._chunks for r in self._rows.values()), "a layer's queries were not captured"
        q = np.stack([np.concatenate(self._rows[il])[start:] for il in range(self.n_layer)])
        self._rows = {}
        return q.reshape(self.n_layer, -1, self.n_head, self.head_dim)

    def _on_tensor(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        if not self._armed:
            return not ask
        t = GgmlTensor.from_address(t_ptr)
        name = t.name
        if not name.startswith(b"Qcur-") or not name[5:].isdigit() or t.op == self._rope:
            return not ask
        layer = int(name[5:])
        if ask:
            return len(self._rows[layer]) < self._chunks
        width = self.n_head * self.head_dim
        n_tokens = int(t.ne[0] * t.ne[1] * t.ne[2] * t.ne[3]) // width
        assert t.type == 0 and t.nb[0] == 4, "pre-RoPE queries are expected as contiguous f32"
        data = np.ctypeslib.as_array(ctypes.cast(t.data, ctypes.POINTER(ctypes.c_float)), shape=(n_tokens, width))
        self._rows[layer].append(data.copy())
        return True
