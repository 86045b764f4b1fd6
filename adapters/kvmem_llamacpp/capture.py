"""Pre-RoPE query capture through llama.cpp's eval callback (``cb_eval``).

The graph names a layer's query ``Qcur-<layer>`` several times: the projection, the projection
plus its bias (models with one, such as qwen2), its 3-D reshape and the RoPE'd result. The
first node with that name whose op is not ROPE holds the content-frame query without its
bias, float32 ``[tokens, heads * head_dim]``: the queries the adapter contract asks for. It is read
with ``ggml_backend_tensor_get``, so capture works whether the layer runs on the CPU or
is offloaded to a GPU (the scheduler has synchronized the backend before the callback).

A *probe* (``stop_after``) needs no layer past the deepest one it captures: the callback asks
for the next layer's query and answers False when it is computed, which makes the scheduler
stop computing that graph split (``ggml_backend_sched_compute_splits`` breaks out of it). The
cells of the probed tokens then hold valid K and V up to ``stop_after`` and stale ones above.
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
        self._stop = n_layer - 1
        self.gate = EvalGate(self._on_tensor)

    def arm(self, n_tokens: int, start: int, stop_after: int | None = None) -> None:
        """Collect the queries of tokens ``start:`` of a forward of ``n_tokens``; call ``next_chunk`` before each
        ``llama_decode`` of it. ``stop_after``: the deepest layer wanted; the graph stops once it is done and the
        queries of deeper layers come back as zeros."""
        self._stop = self.n_layer - 1 if stop_after is None else stop_after
        shape = (self.n_layer, n_tokens - start, self.n_head * self.head_dim)
        self._out = np.empty(shape, dtype=np.float32) if stop_after is None else np.zeros(shape, dtype=np.float32)
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
        assert (self._filled[: self._stop + 1] == self._out.shape[1]).all(), "a layer's queries were not captured"
        return self._out.reshape(self.n_layer, -1, self.n_head, self.head_dim)

    def _on_tensor(self, t_ptr: int, ask: bool, user_data: int) -> bool:
        if not self.gate.armed:
            return not ask
        t = GgmlTensor.from_address(t_ptr)
        name = t.name
        if not name.startswith(b"Qcur-") or not name[5:].isdigit() or t.op == self._rope:
            return not ask
        layer = int(name[5:])
        if layer > self._stop:  # the probe is done once this node is: asked for it, then abort the split
            return ask
        if ask:  # the first such node of each layer, in chunks that hold wanted tokens
            return layer not in self._done and self._hi > self._start
        first = max(self._start, self._lo)
        read_rows(t, t_ptr, first - self._lo, self._out[layer, first - self._start : self._hi - self._start])
        self._filled[layer] += self._hi - first
        self._done.add(layer)
        return True
