"""The native eval gate in front of query capture, and thread counts on a live llama.cpp context."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest

pytest.importorskip("llama_cpp")

from kvmem_core.threads import Threads  # noqa: E402
from kvmem_llamacpp import gate as G  # noqa: E402
from kvmem_llamacpp.ggml import GgmlTensor  # noqa: E402
from llamacpp_support import PARAGRAPH, model_path  # noqa: E402

pytestmark = pytest.mark.llamacpp


def test_the_native_gate_lets_only_armed_query_nodes_into_python() -> None:
    if G.native_library() is None:
        pytest.skip("no C compiler: the Python callback is used directly")
    seen: list[bytes] = []

    def inner(t_ptr: int, ask: bool, user_data: int) -> bool:
        seen.append(GgmlTensor.from_address(t_ptr).name)
        return True

    gate = G.EvalGate(inner)
    assert gate.native
    nodes = [GgmlTensor(name=name) for name in (b"Qcur-3", b"Kcur-3", b"ffn_out-3")]
    ask = [gate.callback(ctypes.addressof(t), True, gate.user_data) for t in nodes]
    assert ask == [False, False, False] and seen == []  # disarmed: "not needed", Python never entered
    gate.armed = True
    ask = [gate.callback(ctypes.addressof(t), True, gate.user_data) for t in nodes]
    assert ask == [True, False, False] and seen == [b"Qcur-3"]


def test_native_gate_and_python_fallback_capture_the_same_queries(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    def captured() -> tuple[np.ndarray, bool]:
        a = LlamaCppAdapter(model_path(), view_tokens=256, block_tokens=64, n_gpu_layers=0)
        try:
            ids = a.tokenize(PARAGRAPH * 2)[:48]
            return a.forward(ids, list(range(len(ids))), capture_from=40).queries, a.capture.gate.native
        finally:
            a.close()

    native, was_native = captured()
    assert was_native == (G.native_library() is not None)
    monkeypatch.setattr(G, "native_library", lambda: None)
    fallback, was_fallback_native = captured()
    assert not was_fallback_native and fallback.shape == (30, 8, 9, 64)
    assert np.array_equal(native, fallback)


def test_capture_reads_only_the_rows_asked_for_across_batches() -> None:
    """A forward split into 64-token batches, captured from token 100 (inside the second batch): its rows equal the
    same forward's captured from 0 (same batches, so the same arithmetic)."""
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    a = LlamaCppAdapter(model_path(), view_tokens=256, block_tokens=64, n_gpu_layers=0, n_batch=64)
    try:
        ids = a.tokenize(PARAGRAPH * 12)[:200]
        assert len(ids) == 200
        whole = a.forward(ids, list(range(200)), capture_from=0).queries
        a.clear_view()
        part = a.forward(ids, list(range(200)), capture_from=100).queries
    finally:
        a.close()
    assert whole.shape == (30, 200, 9, 64) and part.shape == (30, 100, 9, 64)
    assert np.array_equal(part, whole[:, 100:])


def test_thread_counts_reach_the_context() -> None:
    import llama_cpp as L

    from kvmem_llamacpp.adapter import LlamaCppAdapter

    a = LlamaCppAdapter(model_path(), view_tokens=128, n_threads=2, n_threads_batch=3, n_gpu_layers=0)
    try:
        assert (L.llama_n_threads(a.ctx.ptr), L.llama_n_threads_batch(a.ctx.ptr)) == (2, 3)
        a.set_threads(Threads(1, 1))
        assert (L.llama_n_threads(a.ctx.ptr), L.llama_n_threads_batch(a.ctx.ptr)) == (1, 1)
    finally:
        a.close()


def test_unset_counts_follow_the_cores_other_processes_leave_free(monkeypatch: pytest.MonkeyPatch) -> None:
    import llama_cpp as L

    from kvmem_core.thread_governor import ThreadGovernor
    from kvmem_llamacpp.adapter import LlamaCppAdapter

    monkeypatch.delenv("KVMEM_THREADS", raising=False)
    monkeypatch.delenv("KVMEM_THREADS_BATCH", raising=False)
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    a = LlamaCppAdapter(model_path(), view_tokens=128, n_gpu_layers=0)
    clock = iter(range(0, 100, 10))
    busy = iter([(0, 0), (3000, 1000)])  # 10 s later: 30 s of busy cores, 10 s of them this process's
    a._governor = ThreadGovernor(2, ticks=lambda: next(busy), clock=lambda: next(clock), hz=100)
    try:
        assert L.llama_n_threads(a.ctx.ptr) == 2
        a.forward([1, 2], [0, 1])
        assert (L.llama_n_threads(a.ctx.ptr), L.llama_n_threads_batch(a.ctx.ptr)) == (1, 1)
        a.set_threads(Threads(2, 2))  # an explicit count is never governed
        a.forward([3], [2])
        assert L.llama_n_threads(a.ctx.ptr) == 2
    finally:
        a.close()
