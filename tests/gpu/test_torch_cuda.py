"""The torch engine on CUDA: HF oracle (fp32 and bf16), CUDA-graph decode, staged block writes."""

from __future__ import annotations

import copy

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("transformers")

from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402
from torch_tiny import tiny_hf_model, tiny_spec_weights  # noqa: E402
from kvmem_torch.transfer import BlockStager  # noqa: E402

B = 16
torch.backends.cuda.matmul.allow_tf32 = False
torch.backends.cudnn.allow_tf32 = False


@pytest.fixture(scope="module", autouse=True)
def hf_delta_rule_in_torch() -> object:
    """HF's qwen3_5 swaps its delta rule for flash-linear-attention's when that package imports, whose fp32
    products run in TF32: the reference keeps HF's own torch implementation (its ``__wrapped__`` original)."""
    from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen35

    names = ("torch_chunk_gated_delta_rule", "torch_recurrent_gated_delta_rule")
    saved = {name: getattr(hf_qwen35, name) for name in names}
    for name, fn in saved.items():
        setattr(hf_qwen35, name, getattr(fn, "__wrapped__", fn))
    yield
    for name, fn in saved.items():
        setattr(hf_qwen35, name, fn)


@pytest.fixture(scope="module", params=("llama", "qwen35"))
def hf(request: pytest.FixtureRequest) -> object:
    return tiny_hf_model(request.param, seed=3).cuda()


def model_of(hf: object, dtype: torch.dtype) -> Model:
    return Model(*tiny_spec_weights(hf, dtype, "cuda"))


def tokens(n: int, seed: int = 0) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def hf_logits(hf: object, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids], device="cuda")).logits[0].float()


def test_fp32_prefill_matches_hf(hf: object) -> None:
    r, ids = Runner(model_of(hf, torch.float32), 16, B, cuda_graphs=False), tokens(150)
    got, _ = r.forward(ids, list(range(150)), last_only=False)
    assert (got - hf_logits(hf, ids)).abs().max().item() <= 1e-4


def test_bf16_error_is_no_worse_than_hf_bf16(hf: object) -> None:
    """Against the fp32 HF truth, our bf16 logits err about as much as HF's own bf16 run does."""
    r, ids = Runner(model_of(hf, torch.bfloat16), 16, B), tokens(150, seed=1)
    got, _ = r.forward(ids, list(range(150)), last_only=False)
    truth = hf_logits(hf, ids)
    hf_bf16 = hf_logits(copy.deepcopy(hf).to(torch.bfloat16), ids)
    ours_err, hf_err = (got.float() - truth).abs().mean().item(), (hf_bf16 - truth).abs().mean().item()
    agree = lambda x: (x.argmax(-1) == truth.argmax(-1)).float().mean().item()  # noqa: E731
    assert ours_err <= 1.5 * hf_err and agree(got) >= agree(hf_bf16) - 0.05


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16))
def test_graph_decode_equals_eager_decode(hf: object, dtype: torch.dtype) -> None:
    model = model_of(hf, dtype)
    runs = {g: Runner(model, 16, B, cuda_graphs=g) for g in (False, True)}
    ids = tokens(30, seed=2)
    outs: dict[bool, list[torch.Tensor]] = {False: [], True: []}
    for graphs, r in runs.items():
        logits, _ = r.prefill(ids, list(range(30)), chunk=16)
        for step in range(40):  # crosses the 32- and 64-token graph buckets
            nxt = int(logits[-1].argmax())
            logits, _ = r.forward([nxt], [30 + step])
            outs[graphs].append(logits[-1].float().clone())
    assert len(runs[True].graphs) >= 2
    eager, graph = torch.stack(outs[False]), torch.stack(outs[True])
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * eager.abs().max().item()
    assert (eager - graph).abs().max().item() <= tol
    assert torch.equal(eager.argmax(-1), graph.argmax(-1))


def test_staged_block_writes_round_trip_bit_exact(hf: object) -> None:
    model = model_of(hf, torch.bfloat16)
    r, ids = Runner(model, 16, B), tokens(49, seed=5)
    r.prefill(ids[:48], list(range(48)))
    snap = r.state.snapshot()
    expected, _ = r.forward(ids[48:], [48])
    expected = expected.clone()
    r.drop(48, 49)
    blocks = [(p, *(x.cpu() for x in r.read_cells(p, B))) for p in range(0, 48, B)]
    r.clear()
    stager = BlockStager(r.cache)
    stager.put(r, [(k, v, range(p, p + B)) for p, k, v in blocks[:1]])  # pageable: through the pinned ring
    stager.put(r, [(k.pin_memory(), v.pin_memory(), range(p, p + B)) for p, k, v in blocks[1:]])  # straight copies
    assert [len(batch) for _, batch in stager.in_flight] == [len(blocks) - 1]
    stager.wait()
    r.state.restore(snap)
    got, _ = r.forward(ids[48:], [48])
    assert torch.equal(got, expected)


def test_cells_moved_in_place_decode_as_blocks_written_back(hf: object) -> None:
    """A compact-style move (block 1 dropped, block 2 to its positions) read by graph-replayed decode steps."""
    model = model_of(hf, torch.bfloat16)
    r, ids = Runner(model, 16, B), tokens(50, seed=6)
    r.prefill(ids[:48], list(range(48)))
    snap = r.state.snapshot()
    r.drop(16, 32)
    blocks = [(dst, *(x.clone() for x in r.read_cells(src, B))) for src, dst in ((0, 0), (32, 16))]
    r.move_cells([(32, 16, B)])
    got = [r.forward([t], [32 + i])[0].clone() for i, t in enumerate(ids[48:])]
    r.clear()
    r.insert_blocks([(k, v, range(p, p + B)) for p, k, v in blocks])
    r.state.restore(snap)
    expected = [r.forward([t], [32 + i])[0].clone() for i, t in enumerate(ids[48:])]  # a replay rewrites its output
    assert all(torch.equal(a, b) for a, b in zip(got, expected))
