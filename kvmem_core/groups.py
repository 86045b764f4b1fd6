"""Semantic groups of a transcript and the token spans a step must keep, as per-block arrays.

A group is what the selector takes as one unit: a user turn, an assistant turn, or a tool
call (an assistant turn with ``tool_calls``) together with its results: the ``tool`` messages
right after it. A template without native tools gets the call as assistant text and each
result as a user turn that keeps its ``tool_call_id`` (``kvmem.tools_format.render_plain``),
so a result joins the assistant turn before it whatever the rendering. Every other message
(system, developer) is a group of its own.

Groups come from the step's own prompt, not from tags stored with the blocks: every step
renders the whole transcript (the server rebuilds it for ``previous_response_id``), so the
prompt knows every stored block's message, including blocks archived while an earlier step
decoded its answer, which carry no roles when they are stored.

A block whose tokens straddle two groups belongs to the one holding most of its tokens
(ties: the earlier), so each group is a run of whole blocks and groups never overlap; the few
edge tokens of a message in its neighbour's block come with that neighbour.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

Span = tuple[int, int]  # [start, end) token range


def message_groups(messages: Sequence[dict[str, Any]]) -> list[Span]:
    """Message index ranges ``[first, last + 1)`` of the groups of ``messages``, in order, covering them all."""
    out: list[Span] = []
    for i, message in enumerate(messages):
        if out and _is_result(message) and messages[out[-1][0]].get("role") == "assistant":
            out[-1] = (out[-1][0], i + 1)
        else:
            out.append((i, i + 1))
    return out


def _is_result(message: dict[str, Any]) -> bool:
    return message.get("role") == "tool" or "tool_call_id" in message


def token_groups(messages: Sequence[dict[str, Any]], starts: Sequence[int], ends: Sequence[int]) -> tuple[Span, ...]:
    """Token ranges of the groups of ``messages``, message ``i`` spanning tokens ``[starts[i], ends[i])``."""
    return tuple((starts[a], ends[b - 1]) for a, b in message_groups(messages) if ends[b - 1] > starts[a])


def block_groups(spans: Sequence[Span], n_blocks: int, block_tokens: int) -> np.ndarray:
    """Per block, the index of the span in ``spans`` (sorted, disjoint) holding most of its tokens; -1: none.
    Whole-array work: a 1M-token transcript has ~1K groups over ~8K blocks, and each turn asks again."""
    out = np.full(n_blocks, -1, dtype=np.int64)
    s, e = np.asarray(spans, dtype=np.int64).reshape(-1, 2).T
    b0 = s // block_tokens
    count = np.maximum(np.minimum(-(-e // block_tokens), n_blocks) - b0, 0)
    group = np.repeat(np.arange(len(s)), count)  # one entry per (span, block it touches)
    block = np.arange(len(group)) + np.repeat(b0 - np.cumsum(count) + count, count)
    overlap = np.minimum(e[group], (block + 1) * block_tokens) - np.maximum(s[group], block * block_tokens)
    order = np.lexsort((group, -overlap, block))  # per block: the largest overlap, then the earlier span
    first = order[np.flatnonzero(np.diff(block[order], prepend=-1))]
    first = first[overlap[first] > 0]
    out[block[first]] = group[first]
    return out


def overlapping(spans: Sequence[Span], n_blocks: int, block_tokens: int) -> np.ndarray:
    """Per block, whether any of ``spans`` has a token in it."""
    mask = np.zeros(n_blocks, dtype=bool)
    for s, e in spans:
        if e > s:
            mask[s // block_tokens : min(-(-e // block_tokens), n_blocks)] = True
    return mask


def covered(spans: Sequence[Span]) -> int:
    """Tokens in the union of ``spans``."""
    total, reach = 0, 0
    for s, e in sorted(spans):
        s = max(s, reach)
        if e > s:
            total += e - s
            reach = e
    return total
