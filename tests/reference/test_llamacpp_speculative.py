"""Prompt-lookup speculative decoding on the default model (Qwen2.5-Coder-0.5B) is lossless: greedy answers with
``speculative: lookup`` equal those without, token for token, for a turn that rewrites a file it just read (most
drafts accepted) and one without repeats; a drafter that guesses wrong changes nothing either (verification
rejects its tokens), and the view holds exactly the committed tokens afterwards (rejected cells are gone).

Token for token up to a near-tie: a verification forward runs the token and its draft as one batch, whose
arithmetic llama.cpp's CPU kernels group differently from a one-token step (on some CPUs the logits of the two
differ by up to ~0.2 at the top), so where greedy decoding's two best tokens are closer than that the pick may
turn, as it may between two prefill chunkings of the same prompt. A wrong draft taken would part the answers
where the reference's choice is clear."""

from __future__ import annotations

from pathlib import Path
from typing import Iterator

import llama_cpp as L
import numpy as np
import pytest

import kvmem_core.speculative as speculative
from draft_support import verify_every_draft
from kvmem_core.config import KVMemConfig
from kvmem_core.contract import SamplingParams, StepRequest, StepResult
from kvmem_core.engine import KVMemEngine
from kvmem_core.lookup import LookupDrafter
from kvmem_core.sampling import Sampler
from kvmem_core.step import view_sequence

pytestmark = pytest.mark.llamacpp
CFG = KVMemConfig(ctx=4096, budget=2048, gen_budget=256, method="full")
TIE = 0.25  # logits: two best tokens nearer than this are a near-tie that batch arithmetic may turn (docstring)
TOKENS = 48
WRONG_TOKENS = 16  # every wrong draft costs a verification forward: a shorter answer shows the same
SOURCE = (Path(__file__).parents[2] / "kvmem_core" / "lookup.py").read_text()[:1600]
REWRITE = (
    {
        "role": "user",
        "content": f"Here is a file:\n```python\n{SOURCE}```\nRewrite it with LookupDrafter "
        "renamed to NgramDrafter. Output only the file.",
    },
)
STORY = ({"role": "user", "content": "Write a short story about a lighthouse keeper who finds a strange bottle."},)


@pytest.fixture(scope="module")
def engine() -> Iterator[KVMemEngine]:
    from kvmem.models import resolve_model
    from kvmem_core.errors import ModelNotFoundError
    from kvmem_llamacpp import create_adapter

    try:
        path = resolve_model("qwen2.5-coder-0.5b")
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))
    e = verify_every_draft(KVMemEngine(create_adapter(str(path), CFG, n_threads=1), CFG))
    yield e
    e.close()


def greedy_with_margins(
    engine: KVMemEngine, messages: tuple[dict[str, str], ...], monkeypatch: pytest.MonkeyPatch, tokens: int = TOKENS
) -> tuple[StepResult, list[float]]:
    """A greedy answer without speculation, with each pick's margin: its best logit less the second best."""
    margins: list[float] = []
    pick = Sampler.__call__

    def recorded(self: Sampler, logits: np.ndarray) -> int:
        top = np.partition(logits, -2)[-2:]
        margins.append(float(top[1] - top[0]))
        return pick(self, logits)

    with monkeypatch.context() as patch:
        patch.setattr(Sampler, "__call__", recorded)
        return greedy(engine, messages, "off", tokens), margins


def assert_same_up_to_a_near_tie(on: StepResult, off: StepResult, margins: list[float]) -> None:
    """``on`` equals ``off`` token for token, or first parts from it where ``off``'s pick was a near-tie."""
    parted = next((i for i, (a, b) in enumerate(zip(on.token_ids, off.token_ids)) if a != b), None)
    if parted is None and len(on.token_ids) != len(off.token_ids):
        parted = min(len(on.token_ids), len(off.token_ids))
    if parted is not None:
        assert margins[parted] < TIE, f"token {parted} parted where the reference's margin was {margins[parted]:.3f}"
    else:
        assert on.text == off.text


def greedy(engine: KVMemEngine, messages: tuple[dict[str, str], ...], mode: str, tokens: int = TOKENS) -> StepResult:
    request = StepRequest(
        messages=messages, sampling=SamplingParams(temperature=0.0, max_tokens=tokens), overrides={"speculative": mode}
    )
    result = engine.step(request, lambda piece: True)
    assert_view_holds_exactly_the_committed_tokens(engine)
    return result


def assert_view_holds_exactly_the_committed_tokens(engine: KVMemEngine) -> None:
    _, positions = view_sequence(engine.view)
    adapter = engine.adapter
    assert adapter._view == set(positions)
    assert L.llama_memory_seq_pos_max(adapter.ctx.mem, 0) == max(positions)


class WrongDrafter(LookupDrafter):
    """The lookup draft with its second token replaced by another: everything from there on must be rejected."""

    def propose(self, limit: int | None = None) -> list[int]:
        draft = super().propose(limit)
        if len(draft) >= 2:
            draft[1] = (draft[1] + 1) % 1000
        return draft


@pytest.mark.parametrize("messages", [REWRITE, pytest.param(STORY, marks=pytest.mark.slow)], ids=["rewrite", "story"])
def test_lookup_answers_as_greedy_decoding_does(engine: KVMemEngine, messages, monkeypatch) -> None:
    off, margins = greedy_with_margins(engine, messages, monkeypatch)
    on = greedy(engine, messages, "lookup")
    assert len(margins) >= len(off.token_ids)
    assert_same_up_to_a_near_tie(on, off, margins)
    assert "draft_tokens" not in off.timings
    assert 0 <= on.timings["draft_accepted"] <= on.timings["draft_tokens"]
    if messages is REWRITE:
        assert on.timings["draft_accepted"] >= TOKENS // 3, "a rewrite of a file just read accepts most drafts"


def test_wrong_drafts_are_rejected(engine: KVMemEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    off, margins = greedy_with_margins(engine, REWRITE, monkeypatch, WRONG_TOKENS)
    monkeypatch.setattr(speculative, "LookupDrafter", WrongDrafter)
    on = greedy(engine, REWRITE, "lookup", WRONG_TOKENS)
    assert_same_up_to_a_near_tie(on, off, margins)
    assert on.timings["draft_accepted"] < on.timings["draft_tokens"]


def test_sampled_and_formatted_steps_do_not_speculate(engine: KVMemEngine) -> None:
    sampled = StepRequest(
        messages=STORY,
        sampling=SamplingParams(temperature=0.7, seed=1, max_tokens=4),
        overrides={"speculative": "lookup"},
    )
    assert "draft_tokens" not in engine.step(sampled, lambda piece: True).timings
