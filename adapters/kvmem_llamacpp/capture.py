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
from kvmem_llamacpp.ggml import GgmlTensor, op_id, read_rows


class QueryCapture:
    """Holds the eval callback; while armed it copies the pre-RoPE queries of the forward's tokens from ``start``
    on, straight into one array: rows before ``start`` are neither read nor asked for."""

    def __init__(self, n_layer: int, n_head: int, head_dim: int) -> None:
        self.n_layer, self.n_head, self.head_dim = n_layer, n_head, head_dim
        self._rope = op_id("ROPE")
        self._out = np.empty((0, 0, 0), dtype=np.float32)
        self._start, self._lo, self._hi = 0, 0, 0
        self._done: set[int] = set()
        self._filled = np.zeros(n_layer, dtype=np.int64)
        self.gate = EvalGate(self._on_tensor)

    def arm(self, n_tokens: int, start: int) -> None:
        """Collect the queries of tokens ``start:`` of a forward of ``n_tokens``; call ``next_chunk`` before each
        ``llama_decode`` of it."""
        self._out = np.empty((self.n_layer, n_tokens - start, self.n_head * self.head_dim), dtype=np.float32)
        self._start, self._lo, self._hi = start, 0, 0
        self._filled[:] = 0
        self.gate.armed = True

    def next_chunk(self, n_tokens: int) -> None:
        """The next ``llama_decode`` computes the forward's next ``n_tokens`` tokens."""
        self._lo, self._hi = self._hi, self._hi + n_tokens
        self._done = set()

    def take(self) -> np.ndarray:
        """The queries armed for, float32 [layers, tokens, heads, head dim]; disarms."""
        self.gate.armed = False
        assert (self._filled == self._out.shape[1]).all(), "a layer's queries were not captured"
        return self._out.reshape(self.n_layer, -1, self.n_head, self.head_dim)

    def _on_tensor(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        if not self.gate.armed:
            return not ask
        t = GgmlTensor.from_address(t_ptr)
        name = t.name
        if not name.startswith(b"Qcur-") or not name[5:].isdigit() or t.op == self._rope:
            return not ask
        layer = int(name[5:])
        if ask:  # the first such node of each layer, in chunks that hold wanted tokens
            return layer not in self._done and self._hi > self._start
        first = max(self._start, self._lo)
        read_rows(t, t_ptr, first - self._lo, self._out[layer, first - self._start:self._hi - self._start])
        self._filled[layer] += self._hi - first
        self._done.add(layer)
        return True
