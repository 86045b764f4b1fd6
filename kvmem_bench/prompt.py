"""Prompt-building cost: ``build_prompt`` on a long agent transcript against one render + tokenize of it.

``kvmem bench speed`` reports it as ``prompt_building``. Building a prompt renders and
tokenizes the transcript once and finds the message spans in one pass, so its cost stays
within a small factor of the bare render + tokenize however many messages there are.
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
    """Best-of-``rounds`` seconds of ``build_prompt`` and of one render + tokenize on the same transcript."""
    messages = agent_transcript(n_messages)
    base, ids = _best(rounds, lambda: adapter.tokenize(adapter.render_chat(messages, add_generation_prompt=True)))
    build, prompt = _best(rounds, lambda: build_prompt(adapter, StepRequest(messages=messages)))
    assert prompt.ids == ids
    return {
        "messages": n_messages,
        "tokens": len(ids),
        "render_tokenize_s": round(base, 4),
        "build_prompt_s": round(build, 4),
        "ratio": round(build / base, 3),
    }


def _best(rounds: int, fn: Callable[[], Any]) -> tuple[float, Any]:
    best, value = float("inf"), None
    for _ in range(rounds):
        t0 = time.perf_counter()
        value = fn()
        best = min(best, time.perf_counter() - t0)
    return best, value
