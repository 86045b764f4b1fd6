"""Speculative decoding on the torch engine is lossless, on a tiny random Llama and a tiny random qwen35 (Gated
DeltaNet + attention): greedy answers with ``speculative: lookup`` equal those without, token for token, with the
workspace's own drafts, with a drafter that knows the answer (every draft accepted) and with one that knows it but
guesses its second token wrong (every draft cut back after one token); the same for ``speculative: mtp`` on a tiny
qwen35 with a random MTP layer (its own drafts, then the head's guesses replaced by the answer's tokens). Afterwards
the view holds exactly the committed tokens and a hybrid model's recurrent state is the one plain decoding leaves
(the state is rewound to a checkpoint before the verification and rebuilt for the accepted tokens). A model
without MTP layers refuses ``mtp`` by name, at load and per request."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Sequence

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

import kvmem_core.speculative as speculative  # noqa: E402
import kvmem_torch.adapter  # noqa: E402
from kvmem_core.config import KVMemConfig  # noqa: E402
from kvmem_core.contract import SamplingParams, StepRequest, StepResult  # noqa: E402
from kvmem_core.engine import KVMemEngine  # noqa: E402
from kvmem_core.errors import ConfigError  # noqa: E402
from kvmem_core.lookup import LookupDrafter  # noqa: E402
from kvmem_core.step import view_sequence  # noqa: E402
from kvmem_torch.adapter import TorchAdapter  # noqa: E402
from kvmem_torch.mtp import MTPDrafter  # noqa: E402
from draft_support import verify_every_draft  # noqa: E402
from gguf_writer import write_gguf  # noqa: E402
from torch_tiny import tiny_hf_config, tiny_hf_model, tiny_mtp_state  # noqa: E402

B = 16
CFG = KVMemConfig(
    ctx=2048, budget=256, gen_budget=64, block_tokens=B, sink_tokens=16, recent_tokens=32, method="full", cpu_gb=0.01
)
TOKENS = 40
PHRASE = [5, 17, 42, 99, 7, 23, 61, 88, 130, 3, 11, 150]
PROMPT = [*PHRASE, 70, 71, *PHRASE, 80, 81, *PHRASE[:4]]  # repeats: the workspace's own drafts find matches


@pytest.fixture(scope="module", params=["llama", "qwen35"])
def model_path(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.set_num_threads(1)
    hf = tiny_hf_model(request.param, seed=11)
    path = tmp_path_factory.mktemp("spec") / f"{request.param}.gguf"
    write_gguf(path, tiny_hf_config(request.param), hf.state_dict())
    return path


@pytest.fixture(scope="module")
def mtp_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny qwen35 of ``model_path`` with a random MTP layer."""
    config = tiny_hf_config("qwen35")
    path = tmp_path_factory.mktemp("spec") / "qwen35-mtp.gguf"
    write_gguf(path, config, {**tiny_hf_model("qwen35", seed=11).state_dict(), **tiny_mtp_state(config, seed=12)})
    return path


@pytest.fixture(scope="module")
def plain(model_path: Path) -> tuple[StepResult, KVMemEngine]:
    engine = make_engine(model_path)
    return greedy(engine, "off"), engine


def make_engine(path: Path, cfg: KVMemConfig = CFG) -> KVMemEngine:
    adapter = TorchAdapter(path, view_tokens=cfg.view_tokens, block_tokens=B, device="cpu", progress=False)
    return verify_every_draft(KVMemEngine(adapter, cfg, heads=((0, 0),)))


def greedy(engine: KVMemEngine, mode: str) -> StepResult:
    request = StepRequest(
        prompt=" ".join(map(str, PROMPT)),
        sampling=SamplingParams(temperature=0.0, max_tokens=TOKENS),
        overrides={"speculative": mode},
    )
    result = engine.step(request, lambda _: True)
    _, positions = view_sequence(engine.view)
    assert engine.adapter.runner.positions == sorted(positions), "the view holds exactly the committed tokens"
    return result


def oracle(answer: Sequence[int], wrong_at: int | None) -> type[LookupDrafter]:
    """A drafter proposing the next four tokens of ``answer`` (the second one changed when ``wrong_at`` is 1)."""

    class Oracle(LookupDrafter):
        def __init__(self, history: Sequence[int]) -> None:
            super().__init__(history)
            self.start = len(history)

        def propose(self, limit: int | None = None) -> list[int]:
            done = len(self.tokens) - self.start
            draft = list(answer[done : done + min(4, limit or 4)])
            if wrong_at is not None and len(draft) > wrong_at:
                draft[wrong_at] = (draft[wrong_at] + 1) % 160
            return draft

    return Oracle


@pytest.mark.parametrize("drafter", ["lookup", "oracle", "wrong"])
def test_lookup_answers_as_greedy_decoding_does(
    plain, model_path: Path, drafter: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    off, off_engine = plain
    if drafter != "lookup":
        monkeypatch.setattr(speculative, "LookupDrafter", oracle(off.token_ids, 1 if drafter == "wrong" else None))
    engine = make_engine(model_path)
    on = greedy(engine, "lookup")
    assert on.token_ids == off.token_ids and on.text == off.text
    drafted, accepted = on.timings["draft_tokens"], on.timings["draft_accepted"]
    assert 0 <= accepted <= drafted and engine.metrics()["draft_tokens"] == drafted
    if drafter == "oracle":
        assert accepted == drafted >= len(off.token_ids) // 2, "every draft of the answer itself is accepted"
    if drafter == "wrong":
        assert 0 < accepted < drafted, "each wrong draft is cut back after its first token"
    assert_same_state(engine, off_engine)
    engine.close()


def assert_same_state(engine: KVMemEngine, other: KVMemEngine) -> None:
    """A hybrid model's recurrent state is the same in both engines."""
    if engine.adapter.caps.recurrent_state:
        for mine, theirs in zip(vars(engine.adapter.runner.state).values(), vars(other.adapter.runner.state).values()):
            torch.testing.assert_close(mine, theirs, atol=1e-4, rtol=1e-4)


def mtp_oracle(answer: Sequence[int], wrong_at: int | None) -> type[MTPDrafter]:
    """The MTP drafter, its head run as ever, with each guess replaced by the answer's token at its place (the
    second one changed when ``wrong_at`` is 1)."""

    class Oracle(MTPDrafter):
        def __init__(self, *args: object) -> None:
            super().__init__(*args)
            self.done = 0

        def extend(self, tokens: Sequence[int]) -> None:
            super().extend(tokens)
            self.done += len(tokens)

        def propose(self, limit: int | None = None) -> list[int]:
            guess = super().propose(limit)
            draft = list(answer[self.done : self.done + len(guess)])
            if wrong_at is not None and len(draft) > wrong_at:
                draft[wrong_at] = (draft[wrong_at] + 1) % 160
            return draft

    return Oracle


@pytest.mark.parametrize("drafter", ["mtp", "oracle", "wrong"])
def test_mtp_answers_as_greedy_decoding_does(mtp_path: Path, drafter: str, monkeypatch: pytest.MonkeyPatch) -> None:
    off_engine = make_engine(mtp_path)
    off = greedy(off_engine, "off")
    if drafter != "mtp":
        monkeypatch.setattr(
            kvmem_torch.adapter, "MTPDrafter", mtp_oracle(off.token_ids, 1 if drafter == "wrong" else None)
        )
    engine = make_engine(mtp_path, CFG.replace(speculative="mtp"))
    assert engine.adapter.caps.draft_head
    on = greedy(engine, "mtp")
    assert on.token_ids == off.token_ids and on.text == off.text
    drafted, accepted = on.timings["draft_tokens"], on.timings["draft_accepted"]
    assert 0 <= accepted <= drafted and drafted >= len(off.token_ids) // 2, "the head drafts at every verification"
    if drafter == "oracle":
        assert accepted == drafted, "every draft of the answer itself is accepted"
    if drafter == "wrong":
        assert 0 < accepted < drafted, "each wrong draft is cut back after its first token"
    assert_same_state(engine, off_engine)
    engine.close()
    off_engine.close()


def test_mtp_is_refused_without_mtp_layers(model_path: Path) -> None:
    """``--speculative mtp`` at load and ``speculative: mtp`` per request, on a model without MTP layers: a
    ConfigError that names the missing layers; the engine serves on afterwards."""
    with pytest.raises(ConfigError, match="needs a model with MTP layers"):
        make_engine(model_path, CFG.replace(speculative="mtp"))
    engine = make_engine(model_path)
    assert not engine.adapter.caps.draft_head
    with pytest.raises(ConfigError, match="needs a model with MTP layers"):
        greedy(engine, "mtp")
    assert greedy(engine, "off").token_ids
    engine.close()


def test_auto_drafts_only_where_verification_is_cheap(
    model_path: Path, plain: tuple[StepResult, KVMemEngine], monkeypatch: pytest.MonkeyPatch
) -> None:
    """``speculative: auto`` (the default) drafts where the adapter says a draft costs about one token's step (on
    CUDA a verification graph; ``tests/gpu/test_torch_verify_cuda.py``) and decodes plainly elsewhere, as here on
    the CPU; either way the answer is greedy decoding's."""
    off, _ = plain
    monkeypatch.setattr(speculative, "LookupDrafter", oracle(off.token_ids, None))
    engine = make_engine(model_path)
    assert KVMemConfig().speculative == "auto" and not engine.adapter.caps.cheap_drafts
    assert greedy(engine, "auto").timings.get("draft_tokens", 0) == 0
    engine.adapter.caps = dataclasses.replace(engine.adapter.caps, cheap_drafts=True)
    on = greedy(engine, "auto")
    assert on.token_ids == off.token_ids and on.timings["draft_tokens"] >= len(off.token_ids) // 2
    engine.close()
