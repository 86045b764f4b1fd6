"""A draft's verification through a CUDA graph (``Runner.forward_all``): the logits of every token equal an eager
forward's, the padding rows leave no cell behind, and greedy answers with ``speculative: auto`` (lookup here, where
drafts are cheap) equal those without on a tiny llama, graphs and kernels on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from draft_support import verify_every_draft
from gguf_writer import write_gguf
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest
from kvmem_core.engine import KVMemEngine
from kvmem_torch.adapter import TorchAdapter
from kvmem_torch.model import Model
from kvmem_torch.runner import VERIFY_ROWS, Runner
from torch_tiny import tiny_hf_config, tiny_hf_model, tiny_spec_weights

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA")]
B = 16


def ids(n: int, seed: int) -> list[int]:
    return torch.randint(0, 160, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_verification_equals_an_eager_forward_and_leaves_only_its_tokens(dtype: torch.dtype) -> None:
    model = Model(*tiny_spec_weights(tiny_hf_model("llama", seed=3), dtype, "cuda"))
    runs = {graphs: Runner(model, 24, B, cuda_graphs=graphs) for graphs in (True, False)}
    prompt = ids(40, seed=1)
    for r in runs.values():
        r.prefill(prompt, list(range(40)), chunk=16)
    pos = 40
    for n in (2, 5, VERIFY_ROWS, 3, VERIFY_ROWS):  # full and padded runs, in growing view-size buckets
        run, logits = ids(n, seed=n + pos), {}
        for graphs, r in runs.items():
            logits[graphs] = r.forward_all(run, list(range(pos, pos + n))).float().clone()
            keep = n // 2  # a rejection: the tail of the run leaves the view
            r.drop(pos + keep, 1 << 62)
        tol = 1e-4 if dtype == torch.float32 else 2e-2 * logits[False].abs().max().item()
        assert logits[True].shape == logits[False].shape == (n, model.spec.vocab_size)
        assert (logits[True] - logits[False]).abs().max().item() <= tol
        assert runs[True].positions == runs[False].positions
        pos += n // 2
    assert {rows for rows, _ in runs[True].graphs} == {VERIFY_ROWS}
    after = {graphs: r.forward([7], [pos])[0].float() for graphs, r in runs.items()}  # decode sees the same view
    assert (after[True] - after[False]).abs().max().item() <= (1e-4 if dtype == torch.float32 else 0.1)


def test_a_hybrid_model_verifies_eagerly() -> None:
    model = Model(*tiny_spec_weights(tiny_hf_model("qwen35", seed=3), torch.float32, "cuda"))
    r = Runner(model, 16, B)
    r.prefill(ids(20, seed=0), list(range(20)))
    r.forward_all(ids(4, seed=1), [20, 21, 22, 23])
    assert not r.graph_verify and not r.graphs


def test_lookup_answers_as_greedy_decoding_does_with_graphs(tmp_path: Path) -> None:
    path = tmp_path / "llama.gguf"
    write_gguf(path, tiny_hf_config("llama"), tiny_hf_model("llama", seed=11).state_dict())
    cfg = KVMemConfig(ctx=2048, budget=256, gen_budget=96, block_tokens=B, sink_tokens=16, recent_tokens=32)
    text = " ".join(map(str, range(5, 40, 3)))
    answers = {}
    for mode in ("off", "auto"):  # auto: lookup here, where drafts are cheap
        adapter = TorchAdapter(path, view_tokens=cfg.view_tokens, block_tokens=B, device="cuda", dtype="float32")
        assert adapter.caps.cheap_drafts
        engine = verify_every_draft(KVMemEngine(adapter, cfg, heads=((0, 0),)))
        request = StepRequest(
            prompt=f"{text} {text} {text}",
            sampling=SamplingParams(temperature=0.0, max_tokens=64),
            overrides={"speculative": mode},
        )
        answers[mode] = engine.step(request, lambda _: True)
        if mode == "auto":
            assert any(rows == VERIFY_ROWS for rows, _ in adapter.runner.graphs), "verifications ran in a graph"
        engine.close()
    assert answers["auto"].token_ids == answers["off"].token_ids
    assert answers["auto"].timings["draft_tokens"] > 0
