"""Prompt-building cost: ``build_prompt`` on a long agent transcript against one render + tokenize of it.

``kvmem bench speed`` reports it as ``prompt_building``. Building a prompt renders and
tokenizes the transcript once and finds the message spans in one pass, so its cost stays
within a small factor of the bare render + tokenize however many messages there are. The
next turn of a transcript tokenizes only what it adds (``next_turn_s``).
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.contract import StepRequest
from kvmem_core.prompt import build_prompt

WORDS = (
    "build",
    "test",
    "failed",
    "passed",
    "worker",
    "batch",
    "retry",
    "cache",
    "log",
    "error",
    "module",
    "step",
    "import",
    "timeout",
    "merge",
    "branch",
    "deploy",
    "config",
    "value",
    "line",
)


def agent_transcript(n_messages: int, words: int = 120, seed: int = 0) -> tuple[dict[str, str], ...]:
    """A system prompt, then user / assistant / tool-result turns (as plain user turns) of ``words`` words."""
    rng = np.random.default_rng(seed)
    roles = ("user", "assistant", "user")
    messages = [{"role": "system", "content": "You are a build assistant. Keep track of every failure."}]
    for i in range(n_messages - 1):
        text = " ".join(rng.choice(WORDS, words))
        messages.append(
            {"role": roles[i % 3], "content": f"<tool_response>\n{text}\n</tool_response>" if i % 3 == 2 else text}
        )
    return tuple(messages)


def measure(adapter: EngineAdapter, n_messages: int = 500, rounds: int = 3) -> dict[str, Any]:
    """Best-of-``rounds`` seconds of ``build_prompt`` and of one render + tokenize, each round on a transcript of its
    own (a tokenizer reuses the ids of a text it saw: ``kvmem_core.tokens``), and of ``build_prompt`` for the next
    turn of the last (its answer and a new question added: it tokenizes what they add)."""
    transcripts = [agent_transcript(n_messages, seed=seed) for seed in range(2 * rounds)]
    base, ids = _best(
        transcripts[:rounds], lambda m: adapter.tokenize(adapter.render_chat(m, add_generation_prompt=True))
    )
    build, prompt = _best(transcripts[rounds:], lambda m: build_prompt(adapter, StepRequest(messages=m)))
    assert prompt.ids == adapter.tokenize(adapter.render_chat(transcripts[-1], add_generation_prompt=True))
    turn = (*transcripts[-1], {"role": "assistant", "content": "Fixed."}, {"role": "user", "content": "Run it again."})
    next_turn, _ = _best([turn] * rounds, lambda m: build_prompt(adapter, StepRequest(messages=m)))
    return {
        "messages": n_messages,
        "tokens": len(ids),
        "render_tokenize_s": round(base, 4),
        "build_prompt_s": round(build, 4),
        "ratio": round(build / base, 3),
        "next_turn_s": round(next_turn, 4),
    }


def _best(inputs: list[Any], fn: Callable[[Any], Any]) -> tuple[float, Any]:
    """Shortest seconds of ``fn`` over ``inputs``, and its value for the last."""
    best, value = float("inf"), None
    for x in inputs:
        t0 = time.perf_counter()
        value = fn(x)
        best = min(best, time.perf_counter() - t0)
    return best, value
