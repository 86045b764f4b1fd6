"""Think blocks in the decode loop: counted, ended on budget by forcing the closing tag, text made explicit."""

from __future__ import annotations

from typing import Callable

import numpy as np
import pytest

from kvmem_core.contract import SamplingParams
from kvmem_core.reasoning import KNOWN_TAGS, Thinking, inside_block
from kvmem_core.sampling import decode

VOCAB = [b"<think>", b"\n", b"</think>", b"a", b"b.", b"</thi", b"nk>", b"<EOS>"]
NL, CLOSE, A, B, HALF1, HALF2, EOS = 1, 2, 3, 4, 5, 6, 7
CLOSE_IDS = (NL, CLOSE, NL, NL)


def one_hot(token: int) -> np.ndarray:
    logits = np.full(len(VOCAB), -10.0)
    logits[token] = 10.0
    return logits


def run(script: list[int], steer: Thinking | None, max_tokens: int = 20) -> tuple[str, list[int], str]:
    """Greedy decoding of a model that says ``script``, then ends; a forced token (none is in a script) leaves
    the model where it was."""
    said = [*script, EOS]
    pos = 0
    pieces: list[str] = []

    def advance(token: int) -> Callable[[], np.ndarray]:
        nonlocal pos
        pos += token == said[pos]
        logits = one_hot(said[pos])
        return lambda: logits

    text, ids, finish = decode(
        SamplingParams(temperature=0, max_tokens=max_tokens),
        one_hot(said[0]),
        lambda t: VOCAB[t],
        lambda t: t == EOS,
        advance,
        lambda p: pieces.append(p) is None,
        steer,
    )
    assert "".join(pieces) == text
    return text, ids, finish


def thinking(inside: bool, budget: int | None) -> Thinking:
    return Thinking(KNOWN_TAGS[0], inside, budget, CLOSE_IDS)


def test_a_block_the_template_opened_is_closed_when_the_budget_is_spent() -> None:
    steer = thinking(inside=True, budget=3)
    text, ids, finish = run([A] * 10, steer)
    assert text.startswith("<think>aaa\n</think>\n\n") and ids[:7] == [A, A, A, *CLOSE_IDS]
    assert steer.spent == 3 + 2 and not steer.inside  # its closing tag is part of the block
    assert finish == "stop" and text.endswith("a")  # the model went on answering


def test_a_block_the_model_opens_is_counted_from_its_tag() -> None:
    steer = thinking(inside=False, budget=2)
    text, ids, _ = run([B, 0, A, A, A, A], steer)
    assert ids[:4] == [B, 0, A, A] and ids[4:8] == list(CLOSE_IDS)
    assert text.startswith("b.<think>aa\n</think>") and steer.lead == ""


def test_without_a_budget_thinking_is_only_counted() -> None:
    steer = thinking(inside=True, budget=None)
    text, ids, _ = run([A, A, HALF1, HALF2, B], steer)
    assert text == "<think>aa</think>b." and ids == [A, A, HALF1, HALF2, B]
    assert steer.spent == 4 and not steer.inside  # a tag split over two tokens still closes the block


def test_budget_zero_closes_at_once_and_a_closed_block_is_not_forced_again() -> None:
    steer = thinking(inside=True, budget=0)
    text, ids, _ = run([A, A], steer)
    assert text == "<think>\n</think>\n\naa" and ids == [*CLOSE_IDS, A, A]


def test_a_reopened_block_past_the_budget_is_closed_again() -> None:
    steer = thinking(inside=False, budget=1)
    _, ids, _ = run([0, A, A, 0, A, A], steer, max_tokens=30)
    assert ids.count(CLOSE) == 2


@pytest.mark.parametrize(
    "text, inside",
    [("<|im_start|>assistant\n<think>\n", True), ("<think>\n\n</think>\n\n", False), ("assistant\n", False)],
)
def test_inside_block_reads_the_prompts_tail(text: str, inside: bool) -> None:
    assert inside_block(text, KNOWN_TAGS[0]) is inside
