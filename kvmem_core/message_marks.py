"""Where each message of a rendered transcript ends (``kvmem_core.prompt``'s marks).

Message ``i`` ends where the rendering of messages ``[:i+1]`` ends. That rendering is a prefix of the whole
transcript's, so the ends are found in one pass: each message rendered by itself ends with exactly the text the whole
rendering continues with at the previous message's end (whatever a template adds before a lone message, such as a
default system turn, is a head the match skips). Where a template renders a message differently alone (or refuses
to), that one end comes from rendering its prefix.

An agent's turn resends the transcript with a few messages more. Per adapter, the messages rendered alone are kept
(``lone_renderer``), and so are the last transcript's ends with how far into the text finding each read
(``marks_since``): a transcript that starts with the same messages, and with the same text as far as finding their
ends read, keeps those ends and marks only the messages after them.
"""

from __future__ import annotations

import functools
import json
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from kvmem_core.adapter import EngineAdapter
from kvmem_core.contract import StepRequest
from kvmem_core.errors import TemplateError

PROBE_CHARS = 32
LONE_RENDERS = 16384  # messages rendered alone kept per adapter (``lone_renderer``)
Render = Callable[[Sequence[dict[str, Any]], bool], str]
_lone_renders: weakref.WeakKeyDictionary[Any, OrderedDict[tuple[str, str], str]] = weakref.WeakKeyDictionary()


@dataclass(frozen=True)
class _Marks:
    """An adapter's last transcript's message ends (``marks_since``): the render setting, the messages, the text,
    each message's end and how far into the text finding the ends up to it read."""

    setting: str
    messages: list[dict[str, Any]]
    text: str
    ends: list[int]
    reach: list[int]


_last_marks: weakref.WeakKeyDictionary[Any, _Marks] = weakref.WeakKeyDictionary()


def message_ends(
    render: Render, messages: Sequence[dict[str, Any]], text: str, lone: Callable[[dict[str, Any]], str] | None = None
) -> list[int]:
    """Character offset in ``text`` (the whole transcript rendered) where each message's rendering ends; ``lone``
    renders a message alone (default: ``render``, "" where the template refuses it)."""
    return _ends(render, messages, text, lone or functools.partial(_alone, render), [], [])[0]


def _ends(
    render: Render,
    messages: Sequence[dict[str, Any]],
    text: str,
    lone: Callable[[dict[str, Any]], str],
    ends: list[int],
    reach: list[int],
) -> tuple[list[int], list[int]]:
    """``message_ends`` of ``messages`` past the first ``len(ends)``, whose ``ends`` are known; -> (every end, how far
    into ``text`` finding each end and those before it read)."""
    ends, reach = list(ends), list(reach)
    pos, read = (ends[-1], reach[-1]) if ends else (0, 0)
    for i in range(len(ends), len(messages)):
        alone = lone(messages[i])
        n = _continued(alone, text, pos)
        read = max(read, pos + max(len(alone), PROBE_CHARS))
        if n:
            pos += n
        else:
            pos, head = _prefix_end(render, messages[: i + 1], text, pos)
            read = max(read, head)
        ends.append(pos)
        reach.append(read)
    return ends, reach


def marks_since(
    adapter: EngineAdapter, setting: str, render: Render, messages: list[dict[str, Any]], text: str
) -> list[int]:
    """``message_ends``, going on from the adapter's last transcript where this one repeats it: its first messages
    and all the text finding their ends read (an agent's turn marks only its new messages)."""
    last = _last_marks.get(adapter)
    ends, reach = [], []
    if last is not None and last.setting == setting:
        known = _repeated(last, messages, text)
        ends, reach = last.ends[:known], last.reach[:known]
    ends, reach = _ends(render, messages, text, lone_renderer(adapter, setting, render), ends, reach)
    _last_marks[adapter] = _Marks(setting, messages, text, ends, reach)
    return ends


def _repeated(last: _Marks, messages: Sequence[dict[str, Any]], text: str) -> int:
    """How many of ``last``'s messages ``messages`` starts with whose ends hold in ``text``: the messages are equal
    and so is every character finding their ends read (within the last text)."""
    same = 0
    for before, now in zip(last.messages, messages):
        if before != now:
            break
        same += 1

    def holds(k: int) -> bool:
        read = last.reach[k - 1]
        return read <= len(last.text) and text.startswith(last.text[:read])

    if not same or holds(same):  # an agent's turn: all of them (one comparison of the text)
        return same
    low, high = 0, same - 1  # reach grows with k: the largest k that holds, by bisection
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if holds(mid) else (low, mid - 1)
    return low


def _alone(render: Render, message: dict[str, Any]) -> str:
    try:
        return render([message], False)
    except TemplateError:  # e.g. a template that wants turns to alternate from a user turn
        return ""


def render_setting(request: StepRequest) -> str:
    """What a rendering depends on besides the messages: the request's tools and template kwargs."""
    return json.dumps([request.tools, request.template_kwargs], sort_keys=True, default=repr)


def lone_renderer(adapter: EngineAdapter, setting: str, render: Render) -> Callable[[dict[str, Any]], str]:
    """``_alone`` remembered per adapter by the message and the render ``setting`` (``render_setting``; the most recent
    ``LONE_RENDERS``): an agent's turn renders alone only its new messages. What a lone rendering is used for is
    checked against the whole text (``_continued``), so a template whose output changes (a date) costs a fallback,
    never a wrong mark."""
    kept = _lone_renders.setdefault(adapter, OrderedDict())

    def lone(message: dict[str, Any]) -> str:
        key = (setting, _frozen(message))
        text = kept.get(key)
        if text is None:
            text = kept[key] = _alone(render, message)
            while len(kept) > LONE_RENDERS:
                kept.popitem(last=False)
        else:
            kept.move_to_end(key)
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


def _prefix_end(render: Render, prefix: Sequence[dict[str, Any]], text: str, pos: int) -> tuple[int, int]:
    """Where ``prefix``'s own rendering ends in ``text`` (``pos`` when it does not render as a prefix of it), and
    how far into ``text`` finding that read."""
    try:
        head = render(prefix, False)
    except TemplateError:
        return pos, pos
    return (max(pos, len(head)) if text.startswith(head) else pos), len(head)
