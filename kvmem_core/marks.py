"""Where each message of a rendered transcript ends: in characters of its text, then in its tokens.

Message ``i`` ends where the rendering of messages ``[:i+1]`` ends. That rendering is a
prefix of the whole transcript's, so the ends are found in one pass instead of rendering
and tokenizing every prefix: each message rendered by itself ends with exactly the text
the whole rendering continues with at the previous message's end (whatever a template adds
before a lone message, such as a default system turn, is a head the match skips). Where a
template renders a message differently alone (or refuses to), that one end comes from
rendering its prefix. One tokenization of the whole text then maps the character offsets
to token indices through the tokens' byte lengths.

An agent's next request repeats its transcript and adds messages, so what the last request
found is kept per adapter (``_Marked``): the ends of the leading messages both requests
share, wherever finding them read only text both renderings share, carry over, and so do
the byte ends of the tokens both share. A turn works out only what it adds: at a million
tokens that is a few milliseconds a turn less (what a new turn still pays for whole is
rendering the template and one pass over the text).
"""

from __future__ import annotations

import json
import weakref
from bisect import bisect_right
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np

from kvmem_core.adapter import EngineAdapter
from kvmem_core.contract import StepRequest
from kvmem_core.errors import TemplateError
from kvmem_core.step import common_prefix as common_ids
from kvmem_core.tokens import common_prefix as common_text

PROBE_CHARS = 32
LONE_RENDERS = 16384  # messages rendered alone kept per adapter (``lone_renderer``)
Render = Callable[[Sequence[dict[str, Any]], bool], str]
Lone = Callable[[dict[str, Any]], str]
_piece_lengths: weakref.WeakKeyDictionary[Any, np.ndarray] = weakref.WeakKeyDictionary()
_lone_renders: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str], str]] = weakref.WeakKeyDictionary()
_marked: weakref.WeakKeyDictionary[Any, _Marked] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Marked:
    """The last chat prompt marked on an adapter: its setting (``setting``), messages, text, each message's
    character end, the furthest character read to find each end (``reach``, non-decreasing; past the text
    where a prefix's rendering was compared), its tokens and each token's byte end in the text."""

    setting: str
    messages: Sequence[dict[str, Any]]
    text: str
    ends: list[int]
    reach: list[int]
    tokens: np.ndarray
    byte_ends: np.ndarray


def setting(request: StepRequest) -> str:
    """What besides a message its rendering depends on: the request's tools and template kwargs."""
    return json.dumps([request.tools, request.template_kwargs], sort_keys=True, default=repr)


def token_marks(
    adapter: EngineAdapter,
    render: Render,
    request: StepRequest,
    messages: Sequence[dict[str, Any]],
    text: str,
    tokens: np.ndarray,
    offsets: Sequence[int] = (),
) -> list[int]:
    """Token index where each of ``messages`` ends in ``text`` (its rendering, tokenized as ``tokens``), then the
    token index of each further character offset of ``offsets``: the same as marking the request from scratch,
    with what the adapter's last marked request shares carried over (module docstring)."""
    key = setting(request)
    last = _marked.get(adapter)
    last = last if last is not None and last.setting == key else None
    kept = _kept_ends(last, messages, text)
    ends, reach = message_ends(render, messages, text, lone_renderer(adapter, key, render), kept)
    byte_ends = _byte_ends(adapter, tokens, last)
    _marked[adapter] = _Marked(key, messages, text, ends, reach, tokens, byte_ends)
    return _token_indices(text, byte_ends, [*ends, *offsets])


def _kept_ends(last: _Marked | None, messages: Sequence[dict[str, Any]], text: str) -> tuple[list[int], list[int]]:
    """(ends, reach) of the leading messages ``last`` marked that carry over: equal messages (``==``) whose ends
    were found reading only text the two renderings share."""
    if last is None:
        return [], []
    shared = 0
    for old, new in zip(last.messages, messages):
        if old != new:
            break
        shared += 1
    n = min(shared, bisect_right(last.reach, common_text(last.text, text)))
    return last.ends[:n], last.reach[:n]


def message_ends(
    render: Render,
    messages: Sequence[dict[str, Any]],
    text: str,
    lone: Lone | None = None,
    kept: tuple[list[int], list[int]] = ([], []),
) -> tuple[list[int], list[int]]:
    """Character offset in ``text`` (the whole transcript rendered) where each message's rendering ends, and the
    furthest character read to find it and those before; ``lone`` renders a message alone (default: ``render``,
    "" where the template refuses it); ``kept``: those of the first messages, known already."""
    lone = lone or (lambda message: _alone(render, message))
    ends, reach = list(kept[0]), list(kept[1])
    pos, far = (ends[-1], reach[-1]) if ends else (0, 0)
    for i in range(len(ends), len(messages)):
        alone = lone(messages[i])
        n = _continued(alone, text, pos)
        far = max(far, pos + max(len(alone), PROBE_CHARS)) if n else len(text) + 1
        pos = pos + n if n else _prefix_end(render, messages[: i + 1], text, pos)
        ends.append(pos)
        reach.append(far)
    return ends, reach


def _alone(render: Render, message: dict[str, Any]) -> str:
    try:
        return render([message], False)
    except TemplateError:  # e.g. a template that wants turns to alternate from a user turn
        return ""


def lone_renderer(adapter: EngineAdapter, key: str, render: Render) -> Lone:
    """``_alone`` remembered per adapter by the message and ``key`` (``setting``: the request's tools and template
    kwargs), the most recent ``LONE_RENDERS``: an agent's turn renders alone only its new messages. What a lone
    rendering is used for is checked against the whole text (``_continued``), so a template whose output changes
    (a date) costs a fallback, never a wrong mark."""
    kept = _lone_renders.setdefault(adapter, OrderedDict())

    def lone(message: dict[str, Any]) -> str:
        found = (key, _frozen(message))
        text = kept.get(found)
        if text is None:
            text = kept[found] = _alone(render, message)
            while len(kept) > LONE_RENDERS:
                kept.popitem(last=False)
        else:
            kept.move_to_end(found)
        return text

    return lone


def _frozen(value: Any) -> Any:
    """``value`` (a message, or anything in one) as a hashable key that tells apart exactly what JSON would: dicts by
    their sorted items, lists item by item, other values with their type (``1``, ``1.0`` and ``True`` are three).
    Hashing a transcript's messages this way costs a sixth of serializing them (~2 ms against ~12 ms at 1M tokens)."""
    if isinstance(value, dict):
        return tuple(sorted(((str(k), _frozen(v)) for k, v in value.items()), key=lambda item: item[0]))
    if isinstance(value, (list, tuple)):
        return (list, *(_frozen(v) for v in value))
    return value if type(value) is str else (type(value).__name__, repr(value))


def _continued(alone: str, text: str, pos: int) -> int:
    """Length of the longest tail of ``alone`` that ``text`` continues with at ``pos`` (0: none)."""
    probe = text[pos : pos + PROBE_CHARS]
    if not probe:
        return 0
    j = alone.find(probe)
    while j >= 0:  # tails at least a probe long
        if text.startswith(alone[j:], pos):
            return len(alone) - j
        j = alone.find(probe, j + 1)
    for j in range(max(0, len(alone) - len(probe) + 1), len(alone)):  # shorter tails
        if text.startswith(alone[j:], pos):
            return len(alone) - j
    return 0


def _prefix_end(render: Render, prefix: Sequence[dict[str, Any]], text: str, pos: int) -> int:
    """Where ``prefix``'s own rendering ends in ``text``; ``pos`` when it does not render as a prefix of it."""
    try:
        head = render(prefix, False)
    except TemplateError:
        return pos
    return max(pos, len(head)) if text.startswith(head) else pos


def _byte_ends(adapter: EngineAdapter, tokens: np.ndarray, last: _Marked | None) -> np.ndarray:
    """Byte end of each of ``tokens`` in the text they tokenize (their byte lengths accumulated); those of the
    leading tokens ``last`` shares carry over."""
    if last is None or not (head := common_ids(last.tokens, tokens)):
        return np.cumsum(_lengths(adapter, tokens))
    tail = np.cumsum(_lengths(adapter, tokens[head:])) + last.byte_ends[head - 1]
    return np.concatenate((last.byte_ends[:head], tail))


def _token_indices(text: str, byte_ends: np.ndarray, offsets: Sequence[int]) -> list[int]:
    """For each character offset into ``text`` (in any order), how many of its tokens end at or before it, from
    each token's byte end (``byte_ends``); bytes the tokenizer adds in front of the text (a BOS it inserts, a
    leading space) come before offset 0."""
    total = int(byte_ends[-1]) if len(byte_ends) else 0
    lead = total - (len(text) if text.isascii() else len(text.encode("utf-8", "surrogatepass")))
    return np.searchsorted(byte_ends, lead + _byte_offsets(text, offsets), side="right").tolist()


def _byte_offsets(text: str, offsets: Sequence[int]) -> np.ndarray:
    """UTF-8 byte offset of each character offset into ``text`` (a lone surrogate counts its three bytes)."""
    at = np.asarray(offsets, dtype=np.int64)
    if text.isascii():
        return at
    order = np.argsort(at, kind="stable")
    sizes, prev = np.empty(len(at), dtype=np.int64), 0
    for i, k in enumerate(order.tolist()):
        sizes[i] = len(text[prev : offsets[k]].encode("utf-8", "surrogatepass"))
        prev = offsets[k]
    out = np.empty_like(at)
    out[order] = np.cumsum(sizes)
    return out


def _lengths(adapter: EngineAdapter, ids: np.ndarray) -> np.ndarray:
    """Byte length of each token's text, from a table kept per adapter (token bytes cost a call into the engine:
    only ids not seen before make one)."""
    table = _piece_lengths.get(adapter)
    top = int(ids.max()) + 1 if len(ids) else 0
    if table is None or len(table) < top:
        grown = np.full(max(top, 2 * len(table) if table is not None else 0), -1, dtype=np.int64)
        if table is not None:
            grown[: len(table)] = table
        table = _piece_lengths[adapter] = grown
    lengths = table[ids]
    unseen = np.unique(ids[lengths < 0]).tolist()
    for t in unseen:
        table[t] = len(adapter.token_bytes(t))
    return table[ids] if unseen else lengths
