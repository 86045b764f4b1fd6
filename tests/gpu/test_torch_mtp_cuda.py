"""MTP drafting on CUDA: a decode graph hands the MTP head the hidden states of the token it replayed (as an
eager forward does), and greedy answers with ``speculative: mtp`` equal those without on a tiny qwen35 with a
random MTP layer (fp32), graphs and kernels on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)
pytest.importorskip("transformers")
pytest.importorskip("gguf")

from gguf_writer import write_gguf  # noqa: E402
from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_torch.adapter import TorchAdapter  # noqa: E402
from kvmem_torch.hf_loader import weights_from_hf  # noqa: E402
from kvmem_torch.model import Model  # noqa: E402
from kvmem_torch.runner import Runner  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model, tiny_mtp_state, tiny_spec_weights  # noqa: E402

B = 16
CONFIG = tiny_hf_config("qwen35")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_decode_hands_over_the_replayed_hidden_states(dtype: torch.dtype) -> None:
    hf = tiny_hf_model("qwen35", seed=3)
    spec, weights = tiny_spec_weights(hf, dtype, "cuda")
    weights.update(weights_from_hf(spec, tiny_mtp_state(CONFIG, seed=4), dtype, "cuda"))
    runs = {graphs: Runner(Model(spec, dict(weights)), 16, B, cuda_graphs=graphs) for graphs in (True, False)}
    ids = torch.randint(0, 160, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    for r in runs.values():
        r.forward(ids[:30], list(range(30)))
    for i in range(30, 40):
        hidden = {}
        for graphs, r in runs.items():
            r.forward([ids[i]], [i])
            hidden[graphs] = r.model.hidden.clone()
        torch.testing.assert_close(hidden[True], hidden[False], atol=2e-2 if dtype == torch.bfloat16 else 1e-4, rtol=0)


def test_mtp_answers_as_greedy_decoding_does_on_cuda(tmp_path: Path) -> None:
    path = tmp_path / "qwen35-mtp.gguf"
    write_gguf(path, CONFIG, {**tiny_hf_model("qwen35", seed=11).state_dict(), **tiny_mtp_state(CONFIG, seed=12)})
    cfg = KVMemConfig(
        ctx=2048, budget=256, gen_budget=64, block_tokens=B, sink_tokens=16, recent_tokens=32, method="full"
    )
    answers = {}
    for mode in ("off", "mtp"):
        adapter = TorchAdapter(path, view_tokens=cfg.view_tokens, block_tokens=B, device="cuda", dtype="float32")
        engine = KVMemEngine(adapter, cfg, heads=((0, 0),))
        request = StepRequest(
            prompt=" ".join(map(str, range(5, 60, 3))),
            sampling=SamplingParams(temperature=0.0, max_tokens=40),
            overrides={"speculative": mode},
        )
        answers[mode] = engine.step(request, lambda _: True)
        engine.close()
    assert answers["mtp"].token_ids == answers["off"].token_ids
    assert answers["mtp"].timings["draft_tokens"] >= 20, "the head drafts at every verification"
