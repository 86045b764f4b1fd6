"""Think blocks during decoding: where they are, how many tokens they took, ending them on budget.

A chat template "has thinking" when it writes a known pair of think tags (``<think>`` /
``</think>``, Mistral's ``[THINK]`` / ``[/THINK]``). Some templates open the block in the
prompt (the generation prompt ends with ``<think>\\n``), others let the model open it. The
decode loop drives a ``Thinking`` steer: it watches the generated text, counts the tokens
inside think blocks, their closing tags included (``spent``), and once ``budget`` of them
are spent in an open block, forces the tokens of ``"\\n" + close + "\\n\\n"`` so the
model goes on with its answer.

When the prompt leaves the model inside a block, the step's text starts with the open tag
(``lead``), so the text alone says where thinking ends, whoever parses it.
"""

from __future__ import annotations

import codecs
import re
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.contract import StepRequest

TAIL_TOKENS = 16  # prompt tokens whose text tells whether the template opened a think block


@dataclass(frozen=True)
class ThinkTags:
    """The tags around a think block."""

    open: str
    close: str


KNOWN_TAGS = (ThinkTags("<think>", "</think>"), ThinkTags("[THINK]", "[/THINK]"))


def think_tags(template: str) -> ThinkTags | None:
    """The think tags a chat template writes or strips, or None for a template without thinking."""
    return next((t for t in KNOWN_TAGS if t.open in template and t.close in template), None)


def inside_block(text: str, tags: ThinkTags) -> bool:
    """True when ``text`` ends inside a think block (its last open tag is not closed)."""
    return text.rfind(tags.open) > text.rfind(tags.close)


class Thinking:
    """The steer of one step's decode loop (see the module docstring).

    ``forced`` is the next token the loop must take instead of sampling (None: sample);
    ``observe`` is told every token taken, forced or sampled.
    """

    def __init__(self, tags: ThinkTags, inside: bool, budget: int | None, close_ids: Sequence[int]) -> None:
        assert budget is None or budget >= 0
        self.tags, self.inside, self.budget = tags, inside, budget
        self.lead = tags.open if inside else ""
        self.spent = 0
        self._close_ids = tuple(close_ids)
        self._queue: list[int] = []
        self._forcing = False
        self._text = self.lead
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._tag = re.compile(f"{re.escape(tags.open)}|{re.escape(tags.close)}")
        self._arm()

    def forced(self) -> int | None:
        return self._queue.pop(0) if self._queue else None

    def observe(self, data: bytes) -> None:
        """One token's bytes: count it if it was taken inside a block, then follow the tags it completed."""
        if self.inside:
            self.spent += 1
        before = len(self._text)
        self._text += self._decoder.decode(data)
        start = max(0, before - max(len(self.tags.open), len(self.tags.close)) + 1)
        for match in self._tag.finditer(self._text, start):
            if match.end() > before:  # a tag this token completed
                self.inside = match.group() == self.tags.open
                self._forcing = self._forcing and self.inside
        self._text = self._text[-64:]  # only a tail can hold a tag still to complete
        self._arm()

    def _arm(self) -> None:
        if self.inside and not self._forcing and self.budget is not None and self.spent >= self.budget:
            self._queue = list(self._close_ids)
            self._forcing = True


def thinking_for(
    adapter: EngineAdapter, request: StepRequest, prompt_ids: Sequence[int] | np.ndarray
) -> Thinking | None:
    """The steer for a chat step on a template with thinking; None for raw prompts and templates without it."""
    tags = think_tags(adapter.chat_template)
    if tags is None or request.messages is None:
        return None
    inside = inside_block(adapter.detokenize([int(t) for t in prompt_ids[-TAIL_TOKENS:]]), tags)
    return Thinking(tags, inside, request.reasoning_budget, _text_ids(adapter, f"\n{tags.close}\n\n"))


def _text_ids(adapter: EngineAdapter, text: str) -> list[int]:
    """Token ids of ``text`` mid-sequence: without the BOS the tokenizer puts in front of a whole text."""
    return adapter.tokenize(text)[len(adapter.tokenize("")) :]
