"""flash-linear-attention's delta rule replayed from CUDA graphs (``kvmem_torch.rule_graphs``) answers exactly as
the eager call on the same inputs: outputs and final states, with and without a variable-length batch of
snapshot prefixes, for shapes that take turns, and through a bf16 model's chunked prefill."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvmem_torch.deltanet import fla_chunked_rule, fla_rule, prefixes  # noqa: E402
from kvmem_torch.rule_graphs import RuleGraphs  # noqa: E402

if fla_chunked_rule() is None:
    pytest.skip("flash-linear-attention is not installed", allow_module_level=True)

NK, NV, D = 16, 48, 128  # the 27B shape's DeltaNet heads


def rule_inputs(n: int, sequences: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random (q, k, v, g, beta, initial states) as ``fla_rule`` takes them, for ``n`` rows."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device="cuda", generator=g)

    q, k = (randn(1, n, NK, D).bfloat16() for _ in range(2))
    v = randn(1, n, NV, D).bfloat16()
    gate, beta = -F.softplus(randn(1, n, NV)), torch.sigmoid(randn(1, n, NV))
    state = 0.1 * randn(NV, D, D)
    return q, k, v, gate, beta, state.expand(sequences, NV, D, D)


def assert_replays_equal_eager(graphs: RuleGraphs, n: int, batch: object, seed: int) -> None:
    sequences = 1 if batch is None else len(batch.lengths)  # type: ignore[attr-defined]
    args = rule_inputs(n, sequences, seed)
    out, final = graphs(*args, batch)
    ref_out, ref_final = fla_rule(*args, batch)
    assert torch.equal(out, ref_out)
    assert torch.equal(final, ref_final)


@pytest.mark.parametrize("marks", ((), (5, 130, 512)))
def test_a_shape_runs_eager_then_captured_then_replayed_with_the_eager_answer(marks: tuple[int, ...]) -> None:
    T = 640
    batch = prefixes(T, marks, torch.device("cuda")) if marks else None
    n = T + sum(marks)
    graphs = RuleGraphs(fla_rule)
    for seed in range(4):
        assert_replays_equal_eager(graphs, n, batch, seed)
        (shape,) = graphs.shapes.values()
        assert (shape.captured is not None) == (seed >= 1) and not shape.failed


def test_shapes_taking_turns_keep_their_own_inputs_and_graphs() -> None:
    graphs = RuleGraphs(fla_rule)
    batch = prefixes(300, (64,), torch.device("cuda"))
    for seed in range(3):
        assert_replays_equal_eager(graphs, 640, None, seed)
        assert_replays_equal_eager(graphs, 364, batch, 10 + seed)
        assert_replays_equal_eager(graphs, 261, None, 20 + seed)
    assert len(graphs.shapes) == 3 and all(s.captured is not None for s in graphs.shapes.values())


def test_disabled_graphs_run_the_rule_as_it_is() -> None:
    graphs = RuleGraphs(fla_rule)
    graphs.enabled = False
    for seed in range(2):
        assert_replays_equal_eager(graphs, 640, None, seed)
    assert not graphs.shapes


def test_a_hybrid_model_prefills_the_same_with_and_without_graphs() -> None:
    """The small qwen35 shape in bf16, 1,300 tokens in 256-token forwards, two of them with snapshots: logits,
    the recurrent state and every snapshot equal between a runner with graphs and one without."""
    from kvmem_bench.torch_device import qwen35_spec
    from kvmem_bench.torch_weights import random_weights
    from kvmem_torch.model import Model
    from kvmem_torch.runner import Runner

    spec = qwen35_spec("small")
    model = Model(spec, random_weights(spec, torch.bfloat16, "cuda", 0, std=0.1))
    ids = torch.randint(0, spec.vocab_size, (1300,), generator=torch.Generator().manual_seed(0)).tolist()
    marks = {256: (5, 100), 768: (200,)}
    results = []
    for graphs in (False, True):
        runner = Runner(model, num_blocks=24, block_tokens=64, cuda_graphs=graphs)
        logits, snaps = [], []
        for a in range(0, len(ids), 256):
            at = [(o, model.new_state()) for o in marks.get(a, ())]
            logits.append(runner.forward(ids[a : a + 256], list(range(a, min(a + 256, len(ids)))), snapshots=at)[0])
            snaps += [s for _, s in at]
        results.append((torch.cat(logits), runner.state, snaps))
        assert (len(model.rule_graphs.shapes) > 0) == graphs
    (eager, eager_state, eager_snaps), (replayed, state, snaps) = results
    assert torch.equal(eager, replayed)
    assert torch.equal(eager_state.rec, state.rec) and torch.equal(eager_state.conv, state.conv)
    assert all(torch.equal(a.rec, b.rec) and torch.equal(a.conv, b.conv) for a, b in zip(eager_snaps, snaps))


def test_shapes_evicted_turn_after_turn_leave_no_memory_behind() -> None:
    """A new shape a turn (each turn's batch description is new) captures and evicts graphs for as long as the
    session lasts: after the first few, the reserved device memory stays where it was, and every replay still
    answers as the eager call."""
    torch.cuda.empty_cache()
    graphs = RuleGraphs(fla_rule)
    before = torch.cuda.memory_reserved()
    reserved = []
    for i in range(12):  # shorter each time, so that a shape never needs a bigger block than one freed before it
        for seed in range(3):
            assert_replays_equal_eager(graphs, 4096 - 64 * i, None, 100 * i + seed)
        reserved.append(torch.cuda.memory_reserved())
    one_shape = reserved[0] - before
    assert len(graphs.shapes) == 4 and all(s.captured is not None for s in graphs.shapes.values())
    assert reserved[-1] - reserved[3] < one_shape, (one_shape, reserved)
