"""flash-linear-attention's chunked delta rule replayed from CUDA graphs.

A prefill forward calls the rule once per DeltaNet layer, each layer with the same shapes (48 calls a forward at the
27B shape). Through fla's wrappers and Triton's launchers a call costs ~1.5 ms of host time against a fraction of that
on the GPU, so the forwards of a default view's suffix (a few hundred tokens each) wait on the host. Here the calls
of one shape share static input tensors: the first runs eagerly from them (Triton compiles and autotunes there), the
second is captured into a CUDA graph, and every later call copies its inputs in and replays the graph.

A graph reads only its static inputs and the batch description it keeps (``deltanet.Prefixes``): fla's cache of
tensors derived from a batch description is off while capturing, so the graph derives them itself and stays valid
for as long as it is kept. A shape whose capture fails stays eager.

All graphs are captured on one side stream into one memory pool. A turn brings a new batch description, so shapes
are captured and evicted turn after turn, and the caching allocator hands a freed block only to the stream and pool
it came from: a fresh stream or pool per capture left every evicted graph's memory cached (freed only on
``empty_cache`` or a failed allocation, never during a capture), and a long session's captures ran out of device
memory. Sharing is safe because the graphs replay one at a time on one stream and their outputs are read before the
next call.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

# call shapes kept: a turn's full-length forwards share one; marks and the last, shorter forward bring others
MAX_SHAPES = 4
log = logging.getLogger("kvmem.engine")
Rule = Callable[..., tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Shape:
    """One call shape's static inputs, the batch description they go with, and once captured its graph with the
    graph's own outputs (out, final states)."""

    inputs: tuple[torch.Tensor, ...]
    batch: Any
    captured: tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor] | None = None
    failed: bool = False


class RuleGraphs:
    """``rule(q, k, v, g, beta, initial_state, batch) -> (out, final states)`` run eagerly on a shape's first call,
    captured on its second and replayed after that (module docstring). With ``enabled`` False every call runs
    ``rule`` as it is."""

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.enabled = True
        self.shapes: OrderedDict[tuple, _Shape] = OrderedDict()
        self._capture_on: tuple[torch.cuda.Stream, torch.cuda.MemPool] | None = None  # made at the first capture

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial_state: torch.Tensor,
        batch: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """What ``rule`` returns for these inputs. The final states may be the graph's own tensor, which the next
        call of the shape overwrites: whoever reads them does so before that (copies queued on the stream are)."""
        args = (q, k, v, g, beta, initial_state)
        if not self.enabled:
            return self.rule(*args, batch)
        key = (id(batch), q.dtype, *(tuple(x.shape) for x in args))
        shape = self.shapes.get(key)
        first = shape is None
        if shape is None:
            shape = self._add(key, args, batch)
        self.shapes.move_to_end(key)
        for static, x in zip(shape.inputs, args):
            static.copy_(x)
        if not first and shape.captured is None and not shape.failed:
            self._capture(shape)
        if shape.captured is None:
            return self.rule(*shape.inputs, batch)
        graph, out, final = shape.captured
        graph.replay()
        return out.clone(), final

    @contextlib.contextmanager
    def inside_capture(self) -> Iterator[None]:
        """Calls made while a caller captures a graph of its own (a whole forward, ``Runner``): they run ``rule``
        as it is (a graph cannot replay inside another's capture), with fla's tensor cache off as in ``_capture``."""
        before, self.enabled = self.enabled, False
        try:
            with _fla_tensor_cache_off():
                yield
        finally:
            self.enabled = before

    def _add(self, key: tuple, args: tuple[torch.Tensor, ...], batch: Any) -> _Shape:
        if len(self.shapes) >= MAX_SHAPES:
            self.shapes.popitem(last=False)
        shape = _Shape(tuple(torch.empty(x.shape, dtype=x.dtype, device=x.device) for x in args), batch)
        self.shapes[key] = shape
        return shape

    def _capture(self, shape: _Shape) -> None:
        """Record the rule over ``shape``'s static inputs on a side stream (nothing runs until a replay); the
        caller's other threads may use the device meanwhile (thread-local capture). Where that fails for any reason
        (a step that reads back to the host, a device without graphs), the shape stays eager."""
        try:
            if self._capture_on is None:
                self._capture_on = torch.cuda.Stream(), torch.cuda.MemPool()
            (side, pool), graph = self._capture_on, torch.cuda.CUDAGraph()
            side.wait_stream(torch.cuda.current_stream())
            with _fla_tensor_cache_off(), torch.cuda.stream(side):
                graph.capture_begin(pool=pool.id, capture_error_mode="thread_local")
                try:
                    out, final = self.rule(*shape.inputs, shape.batch)
                finally:
                    graph.capture_end()
            torch.cuda.current_stream().wait_stream(side)
        except Exception as exc:  # any: the eager call that follows raises whatever the rule itself raises
            shape.failed = True
            q = tuple(shape.inputs[0].shape)
            log.warning(
                "the delta rule of q %s cannot be captured (%s: %s); it runs eagerly", q, type(exc).__name__, exc
            )
        else:
            shape.captured = graph, out, final


@contextlib.contextmanager
def _fla_tensor_cache_off() -> Iterator[None]:
    """fla's ``tensor_cache`` (tensors derived from a batch description, kept by the description's identity) off,
    so that a graph computes them itself instead of reading tensors an eviction from that cache may free."""
    try:
        import fla.utils
    except ImportError:  # no fla: no cache to turn off
        yield
        return
    before = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
    fla.utils.FLA_DISABLE_TENSOR_CACHE = True
    try:
        yield
    finally:
        fla.utils.FLA_DISABLE_TENSOR_CACHE = before
