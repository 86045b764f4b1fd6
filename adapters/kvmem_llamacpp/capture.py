"""Pre-RoPE query capture through llama.cpp's eval callback (``cb_eval``).

The graph names a layer's query ``Qcur-<layer>`` several times: the projection, the projection
plus its bias (models with one, such as qwen2), its 3-D reshape and the RoPE'd result. The
first node with that name whose op is not ROPE holds the content-frame query without its
bias, float32 ``[tokens, heads * head_dim]``: the queries the adapter contract asks for. It is read
with ``ggml_backend_tensor_get``, so capture works whether the layer runs on the CPU or
is offloaded to a GPU (the scheduler has synchronized the backend before the callback).
"""
from __future__ import annotations

import numpy as np

from kvmem_llamacpp.gate import EvalGate
from kvmem_llamacpp.ggml import GgmlTensor, op_id, read_f32


class QueryCapture:
    """Holds the eval callback; while armed it copies every layer's pre-RoPE queries."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int) -> None:
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self._rope = op_id("ROPE")
        self._chunks = 0
        self._rows: dict[int, list[np.ndarray]] = {}
        self.gate = EvalGate(self._on_tensor)

    def arm(self) -> None:
        """Start collecting queries; call ``next_chunk`` before each ``llama_decode``."""
        self._rows = {il: [] for il in range(self.n_layer)}
        self._chunks = 0
        self.gate.armed = True

    def next_chunk(self) -> None:
        self._chunks += 1

    def take(self, start: int) -> np.ndarray:
        """Queries of tokens ``start:`` of the last forward, float32 [layers, tokens, heads, head dim]; disarms."""
        self.gate.armed = False
        assert all(len(r) == self._chunks for r in self._rows.values()), "a layer's queries were not captured"
        q = np.stack([np.concatenate(self._rows[il])[start:] for il in range(self.n_layer)])
        self._rows = {}
        return q.reshape(self.n_layer, -1, self.n_head, self.head_dim)

    def _on_tensor(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        if not self.gate.armed:
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
        self._rows[layer].append(read_f32(t, t_ptr, n_tokens, width))
        return True
