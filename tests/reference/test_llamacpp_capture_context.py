"""Queries captured in a second context (``--capture-context on``: the view's own context then runs without an
eval callback) equal the ones captured in the view's context, and so does everything after them.

The copy between the contexts is exact but packs the view's cells together, and llama.cpp's attention adds over
cells in slot order: where the view has holes (dropped blocks) the two ways round differently (up to ~0.4 in a
logit on the CPU, up to 1.31 of logits near 20 on an H200), like prefilling in other chunks does. Where the cells are
contiguous they are bit-identical."""

from __future__ import annotations

import numpy as np
import pytest

from llamacpp_support import chat, model_path
from test_llamacpp_retrieval import CFG, PASSKEY, TRANSCRIPT

pytestmark = pytest.mark.llamacpp


@pytest.fixture(scope="module")
def engines():
    from kvmem.engines import load_engine

    pair = {
        separate: load_engine("llama.cpp", str(model_path()), CFG, capture_context=separate)
        for separate in (False, True)
    }
    yield pair
    for engine in pair.values():
        engine.close()


@pytest.mark.slow  # two engines on the default model: ~35 s
def test_a_retrieval_step_answers_the_same_with_either_capture(engines):
    one, two = (engines[s].step(chat(TRANSCRIPT, max_tokens=12), lambda piece: True) for s in (False, True))
    assert one.selection["blocks"] == two.selection["blocks"]
    assert one.token_ids == two.token_ids and PASSKEY in two.text
    ref = engines[False].last_logits
    assert np.abs(ref - engines[True].last_logits).max() < 0.1 * np.abs(ref).max()  # summation order, see above


def test_captured_queries_and_the_view_after_them_are_identical(engines):
    a, b = (engines[s].adapter for s in (False, True))
    ids = a.tokenize("The archive keeps every ledger of the harbour. " * 20)[:200]
    outs = []
    for adapter in (a, b):
        adapter.clear_view()
        adapter.forward(ids[:120], list(range(120)))
        captured = adapter.forward(ids[120:180], list(range(120, 180)), capture_from=20)
        captured_logits = captured.logits.copy()  # the next forward may reuse the buffer
        after = adapter.forward(ids[180:181], [180])  # decodes in the view's own context, over the copied-back cells
        outs.append((captured.queries, captured_logits, after.logits.copy()))
    (q1, l1, n1), (q2, l2, n2) = outs
    assert q1.shape == q2.shape == (a.model.n_layer, 40, a.model.n_head, a.model.head_dim)
    assert np.array_equal(q1, q2) and np.array_equal(l1, l2) and np.array_equal(n1, n2)


def test_by_default_the_capture_context_follows_the_placement_and_gives_way_to_memory(engines):
    from kvmem_core.errors import UnsupportedModelError
    from kvmem_llamacpp.adapter import LlamaCppAdapter
    from kvmem_llamacpp.lowlevel import LlamaContext

    on_cpu = LlamaCppAdapter(model_path(), view_tokens=256, n_gpu_layers=0)
    try:
        assert on_cpu._capture_ctx is None and on_cpu.ctx.gate is not None  # no GPU layers: the callback is cheap
        made = []

        def context(gate):  # the second context asked for finds no memory
            made.append(gate)
            if len(made) == 2:
                raise UnsupportedModelError("llama.cpp could not create a context for this model")
            return LlamaContext(on_cpu.model, 256, on_cpu.ctx.threads, gate=gate)

        view, capture = on_cpu._make_contexts(context, True, optional=True)
        assert capture is None and view.gate is not None and made[0] is None and len(made) == 3
        view.close()
        made.clear()
        with pytest.raises(UnsupportedModelError):
            on_cpu._make_contexts(context, True, optional=False)  # asked for explicitly: the error stands
    finally:
        on_cpu.close()


def test_a_cleared_view_leaves_no_cells_behind_in_the_capture_context(engines):
    """The view copied into the capture context replaces what it held, an empty view too (llama.cpp restores an
    empty sequence by leaving the destination's cells in place): after ``clear_view`` a captured forward may start
    at any position."""
    adapter = engines[True].adapter
    ids = adapter.tokenize("The archive keeps every ledger of the harbour. " * 8)[:40]
    adapter.clear_view()
    first = adapter.forward(ids, list(range(40)), capture_from=30).queries
    adapter.clear_view()
    moved = adapter.forward(ids, list(range(500, 540)), capture_from=30).queries
    assert np.array_equal(first[0], moved[0]) and not np.array_equal(first[5], moved[5])
