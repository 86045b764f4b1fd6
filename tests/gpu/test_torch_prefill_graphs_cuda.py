"""Whole prefill forwards replayed from CUDA graphs (``Runner``'s prefill graphs): flash attention over a key buffer
padded past the view's keys, and the cuDNN split over exact keys, against float64; a bf16 hybrid model's forwards
with graphs against the same forwards without them (logits, the recurrent state, snapshots at offsets that change
from replay to replay), including a capture that fails."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from kvmem_torch.layers import cudnn_prefill, cudnn_prefill_usable, flash_prefill  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402
from torch_tiny import causal_reference  # noqa: E402

T, BLOCK = 256, 64


def test_flash_prefill_stops_at_the_true_key_count() -> None:
    """The 27B shape's attention heads (24 query / 4 key heads of 256): 640 new tokens after 1,400 keys, in a buffer
    of 3,072 rows whose rows past the keys hold anything."""
    torch.manual_seed(0)
    n, new, padded = 2040, 640, 3072
    q = torch.randn(new, 24, 256, device="cuda").bfloat16()
    k, v = (torch.randn(padded, 4, 256, device="cuda").bfloat16() for _ in range(2))
    got = flash_prefill(q, k, v, torch.tensor([n], device="cuda"))
    k[n:], v[n:] = 1e3, -1e3
    assert torch.equal(got, flash_prefill(q, k, v, torch.tensor([n], device="cuda")))
    ref = causal_reference(q, k[:n], v[:n])
    assert (got.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


@pytest.mark.parametrize("n", [640, 2040, 9000])
def test_cudnn_prefill_against_float64(n: int) -> None:
    """cuDNN's split (whole buckets of the keys before without a mask, the remainder and the new tokens' diagonal
    block causally, merged) at the 27B shape's heads: 640 new tokens as the whole view, after 1,400 keys (a
    remainder alone) and after 8,360 (two buckets and a remainder)."""
    if not cudnn_prefill_usable(torch.bfloat16, 256, torch.device("cuda")):
        pytest.skip("cuDNN's attention does not run here")
    torch.manual_seed(0)
    q = torch.randn(640, 24, 256, device="cuda").bfloat16()
    k, v = (torch.randn(n, 4, 256, device="cuda").bfloat16() for _ in range(2))
    got, ref = cudnn_prefill(q, k, v), causal_reference(q, k, v)
    assert (got.double() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item()


def hybrid_model() -> Model:
    from kvmem_bench.torch_device import qwen35_spec
    from kvmem_bench.torch_weights import random_weights

    spec = qwen35_spec("small")
    return Model(spec, random_weights(spec, torch.bfloat16, "cuda", 0, std=0.1))


SNAPSHOTS = {4: (T // 2,), 5: (200,), 6: (7, 190), 7: (T // 3,), 8: (100, 101)}  # forward -> offsets


def run_turns(runner: Runner, ids: list[int]) -> tuple[list[torch.Tensor], list]:
    """``T``-token forwards over ``ids``, the oldest ``T`` positions dropped once the view holds 768 tokens (so a
    forward's view bucket repeats), forwards 4-8 with snapshots at offsets that change (``SNAPSHOTS``: a key with one
    snapshot met three times, with two twice). -> (each forward's last logits, the snapshot states)"""
    out, states = [], []
    for i, a in enumerate(range(0, len(ids), T)):
        if runner.length >= 3 * T:
            runner.drop(runner.positions[0], runner.positions[0] + T)
        snaps = [(o, runner.model.new_state()) for o in SNAPSHOTS.get(i, ())]
        logits, _ = runner.forward(ids[a : a + T], list(range(a, a + T)), snapshots=snaps)
        out.append(logits[-1].float().clone())
        states += [state for _, state in snaps]
    return out, states


def close(want: torch.Tensor, got: torch.Tensor) -> bool:
    return (want.float() - got.float()).abs().max().item() <= 2e-2 * want.float().abs().max().item()


def assert_close_to_eager(model: Model, graphs: Runner, ids: list[int]) -> None:
    eager = Runner(model, num_blocks=24, block_tokens=BLOCK, cuda_graphs=False)
    (want, want_states), (got, got_states) = run_turns(eager, ids), run_turns(graphs, ids)
    assert close(torch.stack(want), torch.stack(got))
    assert torch.equal(torch.stack(want).argmax(-1), torch.stack(got).argmax(-1))
    assert close(eager.state.rec, graphs.state.rec)
    assert len(want_states) == len(got_states) == 7
    for a, b in zip(want_states, got_states):
        assert close(a.rec, b.rec) and close(a.conv, b.conv)


def test_a_hybrid_model_answers_the_same_with_prefill_graphs() -> None:
    model = hybrid_model()
    ids = torch.randint(0, model.spec.vocab_size, (10 * T,), generator=torch.Generator().manual_seed(1)).tolist()
    runner = Runner(model, num_blocks=24, block_tokens=BLOCK, cuda_graphs=True)
    assert runner.graph_prefill and runner.graph_snapshots
    assert_close_to_eager(model, runner, ids)
    captured = {key[2] for key, g in runner.prefill_graphs.items() if g is not None}
    assert captured == {0, 1, 2}


def test_a_failed_capture_runs_eagerly_from_then_on(monkeypatch: pytest.MonkeyPatch) -> None:
    model = hybrid_model()
    ids = torch.randint(0, model.spec.vocab_size, (10 * T,), generator=torch.Generator().manual_seed(2)).tolist()
    runner = Runner(model, num_blocks=24, block_tokens=BLOCK, cuda_graphs=True)

    def refuse(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no graph here")

    monkeypatch.setattr(runner, "_capture", refuse)
    assert_close_to_eager(model, runner, ids)
    assert runner.prefill_graphs and all(g is None for g in runner.prefill_graphs.values())


def test_long_forwards_attend_through_cudnn_eagerly() -> None:
    """With ``Model.use_cudnn_prefill``, forwards whose queries x keys reach ``CUDNN_MIN_PAIRS`` skip the prefill
    graphs (their padded key buffers) and attend through cuDNN's split; the hybrid model answers as it does through
    flash attention (a bare ``Model``'s default)."""
    model = hybrid_model()
    if not model.use_cudnn_prefill(True):
        pytest.skip("cuDNN's attention does not run here")
    n = 3072  # 3,072 new tokens over at least as many keys: 9.4M pairs
    ids = torch.randint(0, model.spec.vocab_size, (3 * n,), generator=torch.Generator().manual_seed(3)).tolist()

    def run(cudnn: bool) -> tuple[torch.Tensor, Runner]:
        model.use_cudnn_prefill(cudnn)
        runner = Runner(model, num_blocks=160, block_tokens=BLOCK, cuda_graphs=True)
        logits = [runner.forward(ids[a : a + n], list(range(a, a + n)))[0][-1].float() for a in range(0, 3 * n, n)]
        return torch.stack(logits), runner

    (want, flash), (got, cudnn) = run(False), run(True)
    assert close(want, got) and torch.equal(want.argmax(-1), got.argmax(-1))
    assert flash.prefill_seen and not cudnn.prefill_seen and not cudnn.prefill_graphs


# forwards after the first three: (length, snapshot offsets, captures queries); lengths padded to 256 in the graphs
PADDED = [(200, (), False), (230, (100,), False), (250, (), True), (199, (150,), False), (220, (), True),
          (241, (), True), (256, (7,), False)]  # fmt: skip


def padded_turns(runner: Runner, ids: list[int]) -> tuple[list[torch.Tensor], list, list]:
    """Three 256-token forwards, then ``PADDED``'s, the view cut back to its last 512 tokens before each. -> (each
    forward's last logits, the snapshot states, the captured queries by layer)"""
    logits, states, queries, a = [], [], [], 0
    for n, offsets, capture in [(T, (), False)] * 3 + PADDED:
        if runner.length > 2 * T:
            runner.drop(runner.positions[0], runner.positions[runner.length - 2 * T])
        snaps = [(o, runner.model.new_state()) for o in offsets]
        out, q = runner.forward(ids[a : a + n], list(range(a, a + n)), capture=capture, snapshots=snaps)
        logits.append(out[-1].float().clone())
        states += [state for _, state in snaps]
        queries += [{layer: x.float().clone() for layer, x in q.items()}] if capture else []
        a += n
    return logits, states, queries


def test_padded_forwards_and_captured_queries_answer_as_eager() -> None:
    """Forwards of 199-256 tokens replay graphs of 256 rows (the padding's keys in the scratch block, the recurrent
    state past it untouched), with snapshots and with the query's rows captured: logits, states and queries as an
    eager runner's."""
    model = hybrid_model()
    ids = torch.randint(0, model.spec.vocab_size, (12 * T,), generator=torch.Generator().manual_seed(3)).tolist()
    eager = Runner(model, num_blocks=24, block_tokens=BLOCK, cuda_graphs=False)
    graphs = Runner(model, num_blocks=24, block_tokens=BLOCK, cuda_graphs=True)
    (want, want_states, want_q), (got, got_states, got_q) = padded_turns(eager, ids), padded_turns(graphs, ids)
    assert close(torch.stack(want), torch.stack(got))
    assert torch.equal(torch.stack(want).argmax(-1), torch.stack(got).argmax(-1))
    assert close(eager.state.rec, graphs.state.rec) and close(eager.state.conv, graphs.state.conv)
    for a, b in zip(want_states, got_states):
        assert close(a.rec, b.rec) and close(a.conv, b.conv)
    assert len(want_q) == len(got_q) == 3
    for a, b in zip(want_q, got_q):
        assert a.keys() == b.keys() and all(a[k].shape == b[k].shape and close(a[k], b[k]) for k in a)
    replayed = {key[2:] for key, g in graphs.prefill_graphs.items() if g is not None and key[0] == T}
    assert {(0, False), (1, False), (0, True)} <= replayed  # (snapshots, captures queries) of 256-row graphs
